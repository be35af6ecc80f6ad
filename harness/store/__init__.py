"""The capture file format: the .npz + _stats.json pair committed as one unit and read back
(format), on top of the file operations that never lose a user's file (files).
"""
