"""A byte-level BPE tokenizer trained here (Llama 3's split rule or GPT-2's), as real byte-level vocabularies are:
the GGUF tests' tokenizer, written offline in a second."""
from pathlib import Path

TEXT = Path(__file__).resolve().parents[2] / "hfsplit" / "training" / "bundled" / "tiny_text.txt"
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]


def write_bpe_tokenizer(folder, *, vocab_size=400, split="llama-bpe"):
    """Train a byte-level BPE of `vocab_size` tokens on the bundled text and save it (tokenizer.json) in `folder`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    tokenizer = Tokenizer(models.BPE())
    if split == "gpt-2":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS[split]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEXT.read_text().splitlines(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=SPECIAL[0], eos_token=SPECIAL[1])
    fast.save_pretrained(folder)
    return fast
