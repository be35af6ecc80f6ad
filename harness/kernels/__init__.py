"""Pure emulated ops: no module state, hooks or I/O. Each has a naive ``*_ref`` twin used by the tests."""
