"""mixq.formats"""
