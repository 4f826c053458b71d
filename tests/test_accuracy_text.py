"""The text ``scripts/accuracy.py`` measures perplexity on ships with the repository and is long
enough (data/accuracy/README.md)."""

from __future__ import annotations

from pathlib import Path

TEXT = Path(__file__).resolve().parents[1] / "data" / "accuracy" / "alice-chapter1.txt"


def test_accuracy_text_has_2000_smollm2_tokens(tokenizer):
    text = TEXT.read_text(encoding="utf-8")
    assert len(tokenizer.encode(text)) >= 2000
