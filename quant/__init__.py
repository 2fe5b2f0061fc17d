"""mixq.quant"""
