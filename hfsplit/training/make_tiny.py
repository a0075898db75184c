"""Regenerate the bundled tiny datasets and the tiny tokenizer, deterministically.

    python -m hfsplit.training.make_tiny            # rewrite the committed files
    python -m hfsplit.training.make_tiny OUT_DIR    # write OUT_DIR/bundled and OUT_DIR/tiny_tokenizer

The tasks (arithmetic, reversing, capitalising, counting) are small enough for a tiny model to learn.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from hfsplit.checkpoint.synthetic import TINY_TOKENIZER_DIR
from hfsplit.training.data import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT, BUNDLED_DIR

SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 256
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# GPT-2-like pieces, but one digit per token so numbers stay learnable for a tiny model.
PRETOKENIZE_PATTERN = r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+"

WORDS = (
    "apple river stone cloud green table house light music water paper horse tiger lemon "
    "bread chair dream field glass heart money night ocean plant quiet robot smile train "
    "voice window yellow zebra basket candle dragon forest garden island jacket kitten "
    "ladder marble number orange pencil rabbit silver tomato violin wizard"
).split()
NOUNS = "cat dog bird fox child farmer teacher robot sailor baker".split()
VERBS = "saw found painted carried liked watched followed counted built opened".split()
ADJECTIVES = "red small old happy quiet bright tall green lazy clever".split()
PLACES = "near the river|in the garden|on the hill|under the bridge|by the sea|in the old house".split("|")


def alpaca_examples(rng: random.Random, count: int) -> list[dict]:
    """`count` alpaca examples drawn from a few simple tasks."""
    tasks = [add_example, subtract_example, reverse_example, upper_example, count_example, question_example]
    return [tasks[i % len(tasks)](rng) for i in range(count)]


def add_example(rng: random.Random) -> dict:
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    return {"instruction": "Add the two numbers.", "input": f"{a} + {b}", "output": str(a + b)}


def subtract_example(rng: random.Random) -> dict:
    a = rng.randint(0, 60)
    b = rng.randint(0, a)
    return {"instruction": "Subtract the second number from the first.", "input": f"{a} - {b}", "output": str(a - b)}


def reverse_example(rng: random.Random) -> dict:
    word = rng.choice(WORDS)
    return {"instruction": "Reverse the word.", "input": word, "output": word[::-1]}


def upper_example(rng: random.Random) -> dict:
    words = " ".join(rng.sample(WORDS, 2))
    return {"instruction": "Write the text in capital letters.", "input": words, "output": words.upper()}


def count_example(rng: random.Random) -> dict:
    word = rng.choice(WORDS)
    return {"instruction": "How many letters are in the word?", "input": word, "output": str(len(word))}


def question_example(rng: random.Random) -> dict:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return {"instruction": f"What is {a} plus {b}?", "input": "", "output": f"{a} plus {b} is {a + b}."}


def chat_examples(rng: random.Random, count: int) -> list[dict]:
    """`count` conversations of one or two turns built from the alpaca tasks, some with a system turn."""
    conversations = []
    for i in range(count):
        messages = [{"role": "system", "content": "You are a helpful assistant."}] if i % 3 == 0 else []
        for example in alpaca_examples(rng, 1 + i % 2 + (i % 5 == 0)):
            question = f"{example['instruction']} {example['input']}".strip()
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": example["output"]}]
        conversations.append({"messages": messages})
    return conversations


def prompt_examples(rng: random.Random, count: int) -> list[dict]:
    """TRL's prompt-only rows with a verifiable `answer` column (GRPO's reward functions check it): "a+b=" sums of
    two digits from 0 to 4."""
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 4), rng.randint(0, 4)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def preference_examples(rng: random.Random, count: int) -> list[dict]:
    """TRL's standard preference rows (prompt, chosen, rejected): the right answer preferred to a near miss."""
    words = ["stone", "river", "cloud", "apple", "tiger", "lemon", "piano", "candle"]
    rows = []
    for i in range(count):
        if i % 4 == 0:
            a, b = rng.randint(2, 60), rng.randint(2, 40)
            rows.append({"prompt": f"What is {a} + {b}?", "chosen": f"{a} + {b} is {a + b}.",
                         "rejected": f"{a} + {b} is {a + b + rng.randint(1, 9)}."})
        elif i % 4 == 1:
            word = rng.choice(words)
            rows.append({"prompt": f"Reverse the word {word}.", "chosen": word[::-1], "rejected": word})
        elif i % 4 == 2:
            word = rng.choice(words)
            rows.append({"prompt": f"Write {word} in capital letters.", "chosen": word.upper(),
                         "rejected": word.capitalize()})
        else:
            word = rng.choice(words)
            rows.append({"prompt": f"How many letters are in {word}?", "chosen": f"{word} has {len(word)} letters.",
                         "rejected": f"{word} has {len(word) + 2} letters."})
    return rows


def text_lines(rng: random.Random, num_bytes: int) -> list[str]:
    """Paragraphs of simple sentences, one per line, about `num_bytes` in all."""
    lines, size = [], 0
    while size < num_bytes:
        sentences = []
        for _ in range(rng.randint(3, 6)):
            subject, thing = rng.choice(NOUNS), rng.choice(WORDS)
            sentence = f"The {rng.choice(ADJECTIVES)} {subject} {rng.choice(VERBS)} a {thing} {rng.choice(PLACES)}."
            sentences.append(sentence)
        line = " ".join(sentences)
        lines.append(line)
        size += len(line) + 1
    return lines


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_data(out: Path) -> None:
    """Write tiny_alpaca.jsonl, tiny_chat.jsonl, tiny_preference.jsonl, tiny_prompts.jsonl and tiny_text.txt into
    `out`."""
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "tiny_alpaca.jsonl", alpaca_examples(random.Random(0), 300))
    write_jsonl(out / "tiny_chat.jsonl", chat_examples(random.Random(1), 50))
    write_jsonl(out / "tiny_preference.jsonl", preference_examples(random.Random(0), 32))  # DPO (issue 23)
    write_jsonl(out / "tiny_prompts.jsonl", prompt_examples(random.Random(0), 64))  # GRPO (issue 31)
    (out / "tiny_text.txt").write_text("\n".join(text_lines(random.Random(2), 50_000)) + "\n")


def tokenizer_corpus(data: Path) -> list[str]:
    """Texts to train the tokenizer on: the bundled data as the formats render it."""
    alpaca = [json.loads(line) for line in (data / "tiny_alpaca.jsonl").read_text().splitlines()]
    chats = [json.loads(line)["messages"] for line in (data / "tiny_chat.jsonl").read_text().splitlines()]
    texts = (data / "tiny_text.txt").read_text().splitlines()
    for e in alpaca:
        prompt = ALPACA_PROMPT if e["input"] else ALPACA_PROMPT_NO_INPUT
        texts.append(prompt.format(**e) + e["output"])
    for messages in chats:
        texts.append("".join(f"{m['role']}\n{m['content']}\n" for m in messages))
    return texts


def write_tokenizer(data: Path, out: Path) -> None:
    """Train a character-level BPE (vocab 256, ASCII alphabet) on the bundled data and save it to `out`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    alphabet = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(tokenizer_corpus(data), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=4096,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(str(out))


def main(argv: list[str]) -> None:
    data, tok = BUNDLED_DIR, TINY_TOKENIZER_DIR
    if argv:
        data, tok = Path(argv[0]) / "bundled", Path(argv[0]) / "tiny_tokenizer"
    write_data(data)
    write_tokenizer(data, tok)
    print(f"wrote {data} and {tok}")


if __name__ == "__main__":
    main(sys.argv[1:])
