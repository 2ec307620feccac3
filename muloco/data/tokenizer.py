"""Tokenizers: byte-level (ids = UTF-8 bytes, vocab 256) and byte-level BPE (Hugging Face `tokenizers`).

`muloco data prepare` trains a BPE on the user's own text (never a download) or loads a tokenizer.json,
and stores it beside the token files; the run directory keeps a copy, so `muloco sample` decodes what a
run learnt without the data. Documents end with an end-of-text id: byte 0 for bytes (as the builtin
corpus), the `<|endoftext|>` special token for BPE.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from muloco.errors import DataError, UserError

EOT_TEXT = "<|endoftext|>"  # GPT-2's end-of-text token, the special token of the BPEs we train
EOT_CANDIDATES = (EOT_TEXT, "</s>", "<eos>", "<|end_of_text|>")  # what a loaded tokenizer.json may call it
BYTE_VOCAB = 256


class ByteTokenizer:
    """UTF-8 bytes as ids; the end-of-text id is byte 0, which text never holds."""

    vocab_size = BYTE_VOCAB
    eot = 0
    name = "byte"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the byte ids; end-of-text (0) and ids beyond a byte (a padded vocabulary) are left out."""
        return bytes(i for i in ids if 0 < i < BYTE_VOCAB).decode("utf-8", errors="replace")


class BpeTokenizer:
    """A `tokenizers.Tokenizer` (tokenizer.json)."""

    name = "tokenizer.json"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        ids = (tokenizer.token_to_id(t) for t in EOT_CANDIDATES)
        self.eot = next((i for i in ids if i is not None), None)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def save(self, path: Path) -> None:
        self.tokenizer.save(str(path))


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise UserError('BPE tokenizers need Hugging Face tokenizers: pip install -e ".[hf]"') from None
    return tokenizers


def load_bpe(path: Path, field: str = "--tokenizer") -> BpeTokenizer:
    tokenizers = _tokenizers()
    try:
        return BpeTokenizer(tokenizers.Tokenizer.from_file(str(path)))
    except Exception as exc:  # tokenizers raises its own Exception type for a bad file
        raise DataError(f"{field}: {path} is not a tokenizer.json tokenizers can read ({exc})") from None


def train_bpe(texts: Iterator[str], vocab_size: int) -> BpeTokenizer:
    """A byte-level BPE (GPT-2's scheme) trained on `texts`, with `<|endoftext|>` as its one special token.

    The 256 byte symbols are always in the vocabulary, so any text encodes; vocab_size counts them, the
    merges and the special token.
    """
    tokenizers = _tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return BpeTokenizer(tokenizer)


def parse_tokenizer_spec(spec: str) -> tuple[str, int | Path | None]:
    """--tokenizer: ("byte", None) | ("bpe", vocab) | ("file", path); a bad spec is a one-line UserError."""
    if spec == "byte":
        return "byte", None
    if spec.startswith("bpe:"):
        try:
            vocab = int(spec[4:])
        except ValueError:
            vocab = 0
        if not BYTE_VOCAB + 1 <= vocab <= 1 << 31:
            raise UserError(
                f"--tokenizer {spec}: a BPE needs an integer vocabulary of at least {BYTE_VOCAB + 1} "
                "(256 bytes + <|endoftext|>), e.g. bpe:4096"
            )
        return "bpe", vocab
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"--tokenizer {spec}: use byte, bpe:VOCAB or the path of a tokenizer.json")
    return "file", path


def load_run_tokenizer(run_dir: Path, info: dict) -> ByteTokenizer | BpeTokenizer:
    """The tokenizer a run's `tokenizer_info.json` names (run_dir.py writes it)."""
    kind = info.get("tokenizer", "byte")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "unknown":
        raise UserError(
            f"RUN_DIR: {run_dir} was trained on token files without meta.json, so how its ids decode is "
            "unknown; prepare the data with `muloco data prepare` (it records the tokenizer) to sample"
        )
    return load_bpe(run_dir / kind, field=str(run_dir))


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character table (Radford et al. 2019, openai/gpt-2 encoder.py `bytes_to_unicode`):
    printable bytes are themselves, the other 68 are shifted past 255, so every byte is a visible character.
    tokenizers' ByteLevel pre-tokenizer and decoder use the same table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


def byte_tokenizer_for_hf():
    """A `tokenizers.Tokenizer` whose ids are the UTF-8 bytes (id b = byte b), as ByteTokenizer: a byte-level
    BPE with the 256 byte symbols and no merges, so Hugging Face loads it without custom code and it
    round-trips any text."""
    tokenizers = _tokenizers()
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in byte_level_alphabet().items()}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def token_byte_lengths(tokenizer: ByteTokenizer | BpeTokenizer, vocab_size: int) -> np.ndarray:
    """UTF-8 bytes of text each id stands for (0 for end-of-text and other special or unused ids), to turn
    a loss per token into bits per byte."""
    lengths = np.zeros(vocab_size, dtype=np.int64)
    if isinstance(tokenizer, ByteTokenizer):
        lengths[1:BYTE_VOCAB] = 1
        return lengths
    to_byte = {char: byte for byte, char in byte_level_alphabet().items()}
    special = {t.content for t in tokenizer.tokenizer.get_added_tokens_decoder().values() if t.special}
    for i in range(min(vocab_size, tokenizer.vocab_size)):
        token = tokenizer.tokenizer.id_to_token(i)
        if token is None or token in special:
            continue
        if all(c in to_byte for c in token):  # a byte-level BPE token: one character per byte
            lengths[i] = len(token)
        else:  # another scheme (e.g. SentencePiece's): its decoded text
            lengths[i] = len(tokenizer.decode([i]).encode("utf-8"))
    return lengths
