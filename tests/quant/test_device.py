import torch

from mixq.quant.device import pick_device


def test_pick_device_explicit_and_default():
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device(torch.device("cpu")) == torch.device("cpu")
    assert pick_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
