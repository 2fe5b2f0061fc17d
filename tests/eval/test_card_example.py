"""The example cards in docs/ are Hugging Face model cards: huggingface_hub parses their front matter, and each
table names every member of its family.json with the bytes recorded there. example-card: a k256 GGUF family
(`mixq convert --size A,B,C`, `mixq eval`, `mixq card`); example-card-exl3: a mini EXL3 family (`mixq convert
--format exl3 --bpw 2.5,3.05,4 --measure proxy`, the same eval and card)."""
import json
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize("example, library", [("example-card", "gguf"), ("example-card-exl3", "exllamav3")])
def test_example_card_parses_and_lists_every_member(example, library):
    card = ModelCard.load(DOCS / example / "README.md")
    data = card.data.to_dict()
    assert data["base_model_relation"] == "quantized" and data["library_name"] == library
    assert data["base_model"] and "mixq" in data["tags"]
    doc = json.loads((DOCS / example / "family.json").read_text())
    assert doc.get("format", "gguf") == {"gguf": "gguf", "exllamav3": "exl3"}[library]
    members = doc["members"]
    assert len(members) == 3
    for m in members:
        row = next(line for line in card.text.splitlines() if f"`{m['file']}`" in line)
        assert f"{m['bytes']:,}" in row and "torch" in row
    assert (DOCS / example / "kld_vs_size.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
