"""architectures"""
