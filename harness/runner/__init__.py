"""A run, from command to pair: pipeline orchestrates; modeloop runs each mode; forwards runs a
mode's blocks with its hooks; studies runs the analyses that run the model more than once;
calibration, pairing (a Quamba checkpoint with its float model), collect (comparison and
storage as modes finish), resume, checks, export, the run's weight bank and its shared ops.
"""
