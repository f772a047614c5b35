"""predictor"""
