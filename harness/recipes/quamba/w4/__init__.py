"""recipes.quamba.w4"""
