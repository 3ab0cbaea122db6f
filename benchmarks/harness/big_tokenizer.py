"""A byte-level BPE tokenizer of any vocabulary size, built offline from a seeded synthetic corpus.

Dummy models have real shapes but no tokenizer of their own: they borrow the default model's
(SmolLM2, 49,152 entries), so whatever scales with the vocabulary on the host (xgrammar's token
bitmask fill and its per-token tables, detokenization) ran at a third of a Llama-3 8B's 128,256.
``bpe_model(config)`` gives a dummy model a tokenizer of exactly its ``vocab_size``: Llama 3's layout
(byte-level BPE entries first, then 256 special tokens, its names: ``<|begin_of_text|>``,
``<|eot_id|>``, ...), Llama 3's pre-tokenizer (words with their leading space, digits in runs of at most
three, punctuation runs, whitespace runs), trained with ``tokenizers`` on text made here from a fixed
seed: pseudo-words of several scripts (Latin, accented Latin, Cyrillic, Greek, CJK) with a Zipf
frequency, prose, numbers, JSON (compact and indented) and code-like lines. The same arguments give
the same tokenizer, byte for byte; it is built once (about a minute for 128K entries on 2 cores) and
kept under ``PREFIXSERVE_CACHE`` (default ``~/.cache/prefixserve``), keyed by its size, seed and this
module's ``VERSION``.

The folder is an HF tokenizer folder (``tokenizer.json``, ``tokenizer_config.json`` with a Llama-3
style chat template, ``<|eot_id|>`` as EOS) beside the model's config (its EOS / BOS ids set to the
tokenizer's), so ``dummy:FOLDER/NAME.json`` loads with this tokenizer as a dummy config beside
SmolLM2's tokenizer files would (``prefixserve.model.loader._dummy_tokenizer_dir``).
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

VERSION = 1  # bump when the corpus or the layout changes: the cache key holds it
SPECIALS = 256  # Llama 3's reserved block at the top of the vocabulary
# Llama 3's pre-tokenizer: contractions, words (one leading non-letter, e.g. the space), 1-3 digits,
# punctuation runs with their newlines, newline runs, whitespace
PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
BOS, EOS, PAD = "<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>"
STOPS = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")  # Llama 3.1's eos_token_id list


def special_tokens() -> list[str]:
    """Llama 3.1's 256 special tokens in id order (offset by the BPE entries)."""
    named = {
        0: "<|begin_of_text|>",
        1: "<|end_of_text|>",
        4: "<|finetune_right_pad_id|>",
        6: "<|start_header_id|>",
        7: "<|end_header_id|>",
        8: "<|eom_id|>",
        9: "<|eot_id|>",
        10: "<|python_tag|>",
    }
    out, reserved = [], 0
    for i in range(SPECIALS):
        if i in named:
            out.append(named[i])
        else:
            out.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return out


# ---- the corpus -------------------------------------------------------------------------------------

_LATIN = {
    "onsets": ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
               "y", "z", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gr", "kn", "pl", "pr", "qu", "sc",
               "sh", "sk", "sl", "sm", "sn", "sp", "st", "str", "sw", "th", "tr", "wh", "wr"],
    "nuclei": ["a", "e", "i", "o", "u", "y", "ai", "au", "ea", "ee", "ei", "ie", "io", "oa", "oo", "ou",
               "ue"],
    "codas": ["", "", "", "b", "ck", "d", "ft", "g", "l", "ld", "ll", "lt", "m", "mp", "n", "nd", "ng",
              "nk", "nt", "p", "r", "rd", "rk", "rm", "rn", "rt", "s", "sh", "ss", "st", "t", "th", "x",
              "ze"],
    "suffixes": ["", "", "", "", "s", "ed", "ing", "er", "ly", "tion", "ment", "ness", "able", "ist",
                 "ize", "ous", "al", "ic", "es", "ers"],
}  # fmt: skip
_ACCENTED = {
    "onsets": _LATIN["onsets"] + ["ç", "ñ", "ž", "š", "ł", "ß"],
    "nuclei": ["a", "e", "i", "o", "u", "á", "é", "í", "ó", "ú", "à", "è", "ä", "ö", "ü", "â", "ê", "ô",
               "ã", "õ", "å", "ø", "æ", "ě", "ą", "ę"],
    "codas": _LATIN["codas"],
    "suffixes": ["", "", "en", "er", "ung", "keit", "ción", "ção", "ité", "ismo", "ować", "ník"],
}  # fmt: skip
_CYRILLIC = {
    "onsets": ["", "б", "в", "г", "д", "ж", "з", "к", "л", "м", "н", "п", "р", "с", "т", "ф", "х", "ц",
               "ч", "ш", "щ", "пр", "ст", "тр", "кр", "гр", "сл", "зв"],
    "nuclei": ["а", "е", "и", "о", "у", "ы", "э", "ю", "я", "ё", "і", "ї"],
    "codas": ["", "", "й", "н", "л", "р", "с", "т", "к", "м", "ст", "нь", "ть"],
    "suffixes": ["", "", "ов", "ами", "ого", "ение", "ский", "ться", "ная", "ые"],
}  # fmt: skip
_GREEK = {
    "onsets": ["", "β", "γ", "δ", "θ", "κ", "λ", "μ", "ν", "ξ", "π", "ρ", "σ", "τ", "φ", "χ", "ψ", "στ",
               "πρ", "τρ"],
    "nuclei": ["α", "ε", "η", "ι", "ο", "υ", "ω", "ά", "έ", "ή", "ί", "ό", "ύ", "ώ", "ου", "αι", "ει"],
    "codas": ["", "", "ς", "ν", "ρ", "σ", "λ"],
    "suffixes": ["", "", "ος", "ης", "ική", "ματα", "ούν"],
}  # fmt: skip
_SCRIPTS = [(_LATIN, 0.74), (_ACCENTED, 0.09), (_CYRILLIC, 0.07), (_GREEK, 0.03)]  # CJK: the rest (0.07)
_CJK = [chr(c) for c in range(0x4E00, 0x4E00 + 3000)] + [chr(c) for c in range(0x3041, 0x3097)]
# real words at the head of the Zipf ranks: function words, and the keys and literals of JSON and code
_COMMON_WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this from or had
by not word but what some we can out other were all there when up use your how said an each she which
do their time if will way about many then them write would like so these her long make thing see him
two has look more day could go come did number sound no most people my over know water than call first
who may down side been now find any new work part take get place made live where after back little
only round man year came show every good me give our under name very through just form sentence great
think say help low line differ turn cause much mean before move right boy old too same tell does set
three want air well also play small end put home read hand port large spell add even land here must
big high such follow act why ask men change went light kind off need house picture try us again animal
point mother world near build self earth father true false null none id type value key data items list
text content message role user assistant system status error result count index size score active
records title description date url email price total amount created updated enabled config options
properties required string integer boolean object array def return import class print len range str
int float dict
"""
_COMMON = tuple(dict.fromkeys(_COMMON_WORDS.split()))
_SYLLABLES = [1, 2, 3, 4, 5]
_SYLLABLE_WEIGHTS = [42, 34, 16, 6, 2]


def _word(rng: random.Random, script: dict[str, list[str]]) -> str:
    n = rng.choices(_SYLLABLES, _SYLLABLE_WEIGHTS)[0]
    parts = [rng.choice(script["onsets"]) + rng.choice(script["nuclei"]) for _ in range(n)]
    suffix = rng.choice(script["suffixes"]) if rng.random() < 0.3 else ""
    return "".join(parts) + rng.choice(script["codas"]) + suffix


def _lexicon(rng: random.Random, size: int) -> list[str]:
    """``size`` distinct pseudo-words, most frequent first (their rank is their Zipf rank): shorter words
    rank higher, as in natural languages."""
    seen: set[str] = set(_COMMON)
    words: list[str] = []
    weights = [w for _, w in _SCRIPTS]
    while len(words) < size:
        pick = rng.random()
        if pick < sum(weights):
            script = rng.choices([s for s, _ in _SCRIPTS], weights)[0]
            word = _word(rng, script)
        else:
            word = "".join(rng.choice(_CJK) for _ in range(rng.choice((1, 2, 2, 3, 4))))
        if word not in seen:
            seen.add(word)
            words.append(word)
    keys = {w: len(w) * (3 if w[0] >= "\u3000" else 1) + rng.gauss(0.0, 2.5) for w in words}
    return list(_COMMON) + sorted(words, key=keys.__getitem__)[: size - len(_COMMON)]


class _Text:
    """The corpus's pieces, drawn from one seeded generator."""

    def __init__(self, rng: random.Random, lexicon: list[str]) -> None:
        self.rng, self.lexicon = rng, lexicon
        self.cum = list(_cumulative(len(lexicon)))

    def word(self) -> str:
        return self.rng.choices(self.lexicon, cum_weights=self.cum)[0]

    def number(self) -> str:
        r, rng = self.rng.random(), self.rng
        if r < 0.45:
            return str(rng.randint(0, 100))
        if r < 0.65:
            return str(rng.randint(0, 10 ** rng.randint(2, 9)))
        if r < 0.85:
            return f"{rng.uniform(-1000, 1000):.{rng.randint(1, 4)}f}"
        if r < 0.95:
            return str(rng.randint(1900, 2030))
        return f"{rng.randint(1, 12):02d}/{rng.randint(1, 28):02d}/{rng.randint(1990, 2030)}"

    def sentence(self) -> str:
        rng = self.rng
        words = []
        for i in range(rng.randint(3, 24)):
            w = self.number() if rng.random() < 0.06 else self.word()
            if i == 0 or rng.random() < 0.05:
                w = w[:1].upper() + w[1:]
            if rng.random() < 0.01:
                w = w.upper()
            if rng.random() < 0.04:
                w = rng.choice(('"{}"', "({})", "'{}'", "[{}]", "{}'s", "{}-" + self.word())).format(w)
            words.append(w)
            if rng.random() < 0.08:
                words[-1] += rng.choice((",", ",", ";", ":", " -", " —"))
        return " ".join(words) + rng.choice((".", ".", ".", "?", "!", "...", ":"))

    def prose(self) -> str:
        paras = [" ".join(self.sentence() for _ in range(self.rng.randint(1, 6)))]
        while self.rng.random() < 0.5:
            paras.append(" ".join(self.sentence() for _ in range(self.rng.randint(1, 6))))
        return "\n\n".join(paras)

    def key(self) -> str:
        rng = self.rng
        parts = [self.word() for _ in range(rng.choice((1, 1, 1, 2, 2, 3)))]
        return rng.choice(("_", "", "-")).join(parts) if rng.random() < 0.8 else parts[0].capitalize()

    def value(self, depth: int) -> Any:
        r, rng = self.rng.random(), self.rng
        if depth < 3 and r < 0.12:
            return {self.key(): self.value(depth + 1) for _ in range(rng.randint(1, 5))}
        if depth < 3 and r < 0.22:
            return [self.value(depth + 1) for _ in range(rng.randint(0, 6))]
        if r < 0.50:
            return " ".join(self.word() for _ in range(rng.randint(1, 4)))
        if r < 0.70:
            return rng.randint(-50, 1000) if rng.random() < 0.8 else round(rng.uniform(-100, 100), 3)
        if r < 0.85:
            return rng.random() < 0.5
        if r < 0.92:
            return None
        return self.number()

    def json(self) -> str:
        rng = self.rng
        doc: Any = {self.key(): self.value(0) for _ in range(rng.randint(1, 8))}
        if rng.random() < 0.3:
            doc = [doc] + [self.value(1) for _ in range(rng.randint(0, 3))]
        style = rng.random()
        if style < 0.4:
            return json.dumps(doc, ensure_ascii=False)
        if style < 0.55:
            return json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
        return json.dumps(doc, ensure_ascii=False, indent=rng.choice((2, 2, 4, "\t")))

    def code(self) -> str:
        rng = self.rng
        lines, indent = [], 0
        for _ in range(rng.randint(2, 14)):
            name = "_".join(self.word() for _ in range(rng.randint(1, 3)))
            camel = self.word() + self.word().capitalize()
            form = rng.choice((
                f"def {name}({camel}, {self.word()}={self.number()}):",
                f"{name} = {camel}.{self.word()}({self.word()}, {self.number()})",
                f"if {name} >= {self.number()} and not {camel}:",
                f"return {{'{self.word()}': {name}, '{self.word()}': [{self.number()}]}}",
                f"for {self.word()} in range({self.number()}):",
                f"const {camel} = {name}[{self.number()}] || \"{self.word()}\";",
                f"# {self.sentence()}",
                f"{camel}->{name}({self.number()});",
            ))  # fmt: skip
            lines.append(" " * indent + form)
            indent = indent + 4 if form.endswith(":") else max(0, indent - rng.choice((0, 0, 4)))
        return "\n".join(lines)

    def document(self) -> str:
        r = self.rng.random()
        if r < 0.55:
            return self.prose()
        if r < 0.80:
            return self.json()
        if r < 0.95:
            return self.code()
        return " ".join(self.number() for _ in range(self.rng.randint(3, 30)))


def _cumulative(n: int) -> Iterator[float]:
    total = 0.0
    for rank in range(n):
        total += 1.0 / (rank + 8) ** 0.9
        yield total


def corpus(seed: int, documents: int, lexicon: int) -> Iterator[list[str]]:
    """The training text: ``documents`` documents in batches of 1,000, words from a ``lexicon`` of
    pseudo-words; each batch also carries a slice of the lexicon as a word list, so every word is seen
    (BPE needs rare words too, to have pairs to merge up to a large vocabulary)."""
    rng = random.Random(seed)
    words = _lexicon(rng, lexicon)
    text = _Text(rng, words)
    batches = -(-documents // 1000)
    per = -(-len(words) // batches)
    for b in range(batches):
        docs = [text.document() for _ in range(min(1000, documents - b * 1000))]
        docs.append(" ".join(words[b * per : (b + 1) * per]))
        yield docs


# ---- the tokenizer ----------------------------------------------------------------------------------


def build(vocab_size: int, seed: int = 0, documents: int | None = None, lexicon: int | None = None) -> Any:
    """A ``tokenizers.Tokenizer`` of exactly ``vocab_size`` entries: BPE ids first, then the specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 1024:
        raise ValueError(f"vocab_size {vocab_size}: at least 1,024 (256 bytes, merges, 256 specials)")
    entries = vocab_size - SPECIALS
    documents = documents or max(2000, entries // 2)
    lexicon = lexicon or max(1000, entries * 3)
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=entries,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    core.train_from_iterator(corpus(seed, documents, lexicon), trainer)
    if core.get_vocab_size() != entries:
        raise RuntimeError(f"the corpus gave {core.get_vocab_size()} BPE entries, not {entries}")
    core.add_special_tokens(special_tokens())
    bos = core.token_to_id(BOS)
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    assert core.get_vocab_size() == vocab_size
    return core


def _key(vocab_size: int, seed: int) -> str:
    return f"bpe-{vocab_size}-seed{seed}-v{VERSION}"


def tokenizer_dir(vocab_size: int, seed: int = 0, root: Path | None = None, log: bool = True) -> Path:
    """The HF tokenizer folder of ``build(vocab_size, seed)``: built on the first call (atomically:
    a folder made aside and renamed), found on later ones."""
    from prefixserve.config import cache_dir, cache_entry

    root = root or cache_dir() / "bench-tokenizers"
    out = root / _key(vocab_size, seed)
    if (out / "built.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if log:
        print(f"building a {vocab_size:,}-entry BPE tokenizer (seed {seed}) into {out} ...", flush=True)
    core = build(vocab_size, seed)
    seconds = time.perf_counter() - t0
    with cache_entry(out) as tmp:
        tmp.chmod(0o755)
        core.save(str(tmp / "tokenizer.json"))
        # written by hand, not by transformers' save_pretrained: the class name transformers 4 and 5 both
        # build directly (``loader._plain_fast_tokenizer``), and the chat template inline
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
                  "pad_token": PAD, "chat_template": CHAT_TEMPLATE, "model_max_length": 131072,
                  "clean_up_tokenization_spaces": False}  # fmt: skip
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        digest = hashlib.sha256((tmp / "tokenizer.json").read_bytes()).hexdigest()
        meta = {"vocab_size": vocab_size, "seed": seed, "version": VERSION, "build_s": round(seconds, 1),
                "tokenizer_json_sha256": digest}  # fmt: skip
        (tmp / "built.json").write_text(json.dumps(meta, indent=1))
    if log:
        print(f"built in {seconds:.1f} s", flush=True)
    return out


def tokenizer_info(folder: Path) -> dict[str, Any]:
    """What a result records of the tokenizer: its size, seed, build time, digest."""
    return dict(json.loads((folder / "built.json").read_text()))


def bpe_model(config: dict[str, Any], name: str = "config", seed: int = 0, root: Path | None = None) -> str:
    """``config`` (a dummy model's, as a dict) written beside a BPE tokenizer of its ``vocab_size``,
    its EOS / BOS ids the tokenizer's; returns the model name ``dummy:FOLDER/NAME.json``."""
    folder = tokenizer_dir(int(config["vocab_size"]), seed, root)
    base = int(config["vocab_size"]) - SPECIALS
    names = special_tokens()
    config = dict(config)
    config["bos_token_id"] = base + names.index(BOS)
    config["eos_token_id"] = [base + names.index(s) for s in STOPS]
    path = folder / f"{name}.json"
    text = json.dumps(config, indent=1)
    if not path.is_file() or path.read_text() != text:
        tmp = path.with_suffix(f".{time.monotonic_ns()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return f"dummy:{path}"


__all__ = [
    "SPECIALS",
    "VERSION",
    "bpe_model",
    "build",
    "corpus",
    "special_tokens",
    "tokenizer_dir",
    "tokenizer_info",
]
