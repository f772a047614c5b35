"""migrator"""
