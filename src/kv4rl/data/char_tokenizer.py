"""A character-level tokenizer for the synthetic arithmetic task, saved as a normal HF tokenizer.

Why character level: the tiny demo model has to learn arithmetic digit by digit, and a vocabulary of
twenty-odd symbols keeps its embedding table and softmax negligible. Why `\\boxed{` is one token: the
answer format then costs the model a single decision, so warm-up time goes into the arithmetic.

Encoding contract (tested): `encode(s)` maps every character of `s` to one id, except that each
`\\boxed{` becomes the single `BOXED` id. No post-processor is installed, so `add_special_tokens=True`
(the HF default) inserts nothing: no BOS, no EOS. Callers append `eos_token_id` themselves where a
sequence must end. Decoding concatenates the token strings without separators, so
`decode(encode(s)) == s` for any string over the vocabulary. Characters outside the vocabulary map to
`<unk>`, which decodes to the literal text `<unk>`.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD = "<pad>"
EOS = "<eos>"
UNK = "<unk>"
BOXED = "\\boxed{"
# Order fixes the ids: specials first so pad=0, eos=1, unk=2 whatever the symbol set becomes.
SPECIAL_TOKENS = (PAD, EOS, UNK)
SYMBOLS = tuple("0123456789") + tuple("+-*=() {}") + (BOXED,)
VOCAB = SPECIAL_TOKENS + SYMBOLS

# `\boxed{` must win over its own characters, then every remaining character stands alone.
_PIECE_PATTERN = r"\\boxed\{|."


def _build_backend() -> Tokenizer:
    vocab = {token: index for index, token in enumerate(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # "isolated" keeps every match as its own piece; spaces are ordinary pieces, never dropped.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(_PIECE_PATTERN), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def build_char_tokenizer(out_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """Build the tokenizer; when `out_dir` is given also `save_pretrained` it there.

    The saved folder loads back with `AutoTokenizer.from_pretrained(out_dir)` and encodes identically.
    """
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_build_backend(),
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer
