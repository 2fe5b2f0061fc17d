"""mixq.convert"""
