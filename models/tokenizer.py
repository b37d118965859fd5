"""Character-level tokenizer for the embedded tiny model, built locally (no downloads).

Every character of the embedded `arith` task is one token, so a ~1M-parameter model learns the
task in CPU minutes. The tokenizer is saved in Hugging Face format, so
`AutoTokenizer.from_pretrained(dir)` loads it like any other.
"""
from __future__ import annotations

from tokenizers import Tokenizer, decoders
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIALS = (PAD, EOS, UNK)
# The alphabet of the embedded task: lowercase words, digits, arithmetic and layout characters.
CHARSET = "abcdefghijklmnopqrstuvwxyz0123456789 \n.,:;?!'+-*/=()#_[]<>|"


def build_char_tokenizer(charset: str = CHARSET) -> PreTrainedTokenizerFast:
    """A tokenizer whose tokens are the specials followed by one token per character of `charset`."""
    if len(set(charset)) != len(charset):
        raise ValueError("charset has repeated characters")
    vocab = {tok: i for i, tok in enumerate(SPECIALS + tuple(charset))}
    # BPE with no merges over an un-pre-tokenized string is exactly "one token per character".
    core = Tokenizer(BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()
    # Generation pads prompts on the left.
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )
