"""The process around a run: clean interruption and the output lock (guard), heap memory (memory),
and what machine and torch build computed the numbers (machine). Imports nothing else of the harness.
"""
