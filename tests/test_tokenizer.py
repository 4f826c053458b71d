"""hx's tokenizer (built from GGUF metadata) vs the Hugging Face tokenizer of the same file."""

import pytest

STRINGS = [
    "", " ", "  ", "\n", "\n\n\n", "\t", " \t \n ", "a", "Hello, world!", "hello world",
    "Hello   world", "   leading spaces", "trailing spaces   ", "line one\nline two\r\nthree",
    "The quick brown fox jumps over the lazy dog.", "It's a dog's life; isn't it?",
    "I'm, you're, they'll, we'd, she's", "ALL CAPS SENTENCE", "CamelCaseIdentifierName",
    "snake_case_identifier = 42", "12345", "3.14159265358979", "1,000,000 and 2nd place",
    "phone: +1 (555) 010-9999", "2026-11-22T00:26:24Z", "x1 y22 z333",
    "héllo wörld", "naïve café résumé", "Ελληνικά γράμματα", "Русский текст", "中文分词测试",
    "日本語のテキスト", "한국어 텍스트", "עברית", "العربية", "हिन्दी", "emoji 😀😃😄",
    "family 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵", "🙂", "mixed 🚀 rocket 123 ✓ ✗",
    "def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "<html><body><p class=\"x\">hi</p></body></html>", "SELECT * FROM users WHERE id = 1;",
    "{\"key\": [1, 2, {\"nested\": null}]}", "$ echo $HOME && ls -la ~/", "a\u00a0b non-breaking",
    "zero\u200bwidth", "tab\tseparated\tvalues", "    indented code block",
    "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>", "text<|im_end|>more", "<|im_start",
    "Mr. Smith's \"quoted\" text — with dashes – and ellipsis…", "((((nested))))", "!!!???...",
    "https://example.com/path?query=1&b=2#frag", "user@example.com", "\\n literal backslash n",
    "ﬁ ligature and Å angstrom", "   \n   \n", "a" * 300,
]


def test_at_least_fifty_strings():
    assert len(STRINGS) >= 50 and "" in STRINGS


@pytest.mark.parametrize("text", STRINGS)
def test_ids_equal_hugging_face(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=True)


@pytest.mark.parametrize("text", [s for s in STRINGS if "<|" not in s])
def test_decode_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_tokens_and_chat_template(tokenizer, hf_tokenizer):
    assert tokenizer.eos_id == hf_tokenizer.eos_token_id == 2
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ours = tokenizer.render_chat("What is 2+2?")
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=True)
    assert ours == theirs
    assert tokenizer.encode(ours)[:1] == [1]  # <|im_start|> is one special token
