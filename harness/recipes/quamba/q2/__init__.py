"""recipes.quamba.q2"""
