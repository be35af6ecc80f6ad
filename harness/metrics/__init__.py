"""Numbers about arrays: error metrics (errors), |error| percentiles, next-token metrics on logits,
confidence intervals and the comparison of every mode against a reference (compare).
"""
