"""mixq.eval"""
