"""The example card in docs/ (a k256 family, made by `mixq convert --size A,B,C`, `mixq eval`, `mixq card`) is a
Hugging Face model card: huggingface_hub parses its front matter, and its table names every member of its
family.json with the bytes recorded there."""
import json
from pathlib import Path

from huggingface_hub import ModelCard

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "example-card"


def test_example_card_parses_and_lists_every_member():
    card = ModelCard.load(EXAMPLE / "README.md")
    data = card.data.to_dict()
    assert data["base_model_relation"] == "quantized" and data["library_name"] == "gguf"
    assert data["base_model"] and "mixq" in data["tags"]
    members = json.loads((EXAMPLE / "family.json").read_text())["members"]
    assert len(members) == 3
    for m in members:
        row = next(line for line in card.text.splitlines() if f"`{m['file']}`" in line)
        assert f"{m['bytes']:,}" in row and "torch" in row
    assert (EXAMPLE / "kld_vs_size.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
