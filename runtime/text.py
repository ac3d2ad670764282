"""Text for the language models: a tokenizer of Python source built on the standard `tokenize`
module, whose vocabulary travels inside the model file (net.assets['vocabulary']).

Tokens are the source's own tokens (names, keywords, operators) with numbers and strings folded
into '<num>' and '<str>', comments dropped, and the layout kept as '<nl>', '<indent>' and
'<dedent>', so decoding gives back runnable-looking code. Ids not in the vocabulary are '<unk>'.
"""
import io
import keyword
import tokenize
from collections import Counter

SPECIALS = ["<unk>", "<nl>", "<indent>", "<dedent>", "<num>", "<str>"]
UNK = 0


def source_tokens(text):
    """The token strings of Python source (see the module docstring); a file that does not
    tokenize yields what it had up to the error."""
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            kind = tok.type
            if kind == tokenize.NAME or kind == tokenize.OP:
                out.append(tok.string)
            elif kind == tokenize.NUMBER:
                out.append("<num>")
            elif kind == tokenize.STRING or kind in _FSTRING_PARTS:
                if not out or out[-1] != "<str>":
                    out.append("<str>")
            elif kind == tokenize.NEWLINE:
                out.append("<nl>")
            elif kind == tokenize.INDENT:
                out.append("<indent>")
            elif kind == tokenize.DEDENT:
                out.append("<dedent>")
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return out


_FSTRING_PARTS = {getattr(tokenize, n) for n in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END")
                  if hasattr(tokenize, n)}


class PythonTokenizer:
    """Token strings <-> ids over a fixed vocabulary (a list of strings, SPECIALS first)."""

    def __init__(self, vocabulary):
        vocabulary = list(vocabulary)
        if vocabulary[:len(SPECIALS)] != SPECIALS:
            raise ValueError(f"PythonTokenizer: the vocabulary must start with {SPECIALS}, found {vocabulary[:6]}")
        self.vocabulary = vocabulary
        self.index = {t: i for i, t in enumerate(vocabulary)}

    @classmethod
    def build(cls, texts, size):
        """The `size` most frequent tokens of `texts` (ties broken by the token)."""
        counts = Counter()
        for text in texts:
            counts.update(source_tokens(text))
        for s in SPECIALS:
            counts.pop(s, None)
        common = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size - len(SPECIALS)]
        return cls(SPECIALS + [t for t, _ in common])

    def __len__(self):
        return len(self.vocabulary)

    def encode(self, text):
        return [self.index.get(t, UNK) for t in source_tokens(text)]

    def decode(self, ids, indent=0):
        """Readable source from ids; `indent` is the block depth to start at."""
        words, line, depth = [], [], indent
        def flush():
            if line:
                words.append("    " * depth + _join(line))
                line.clear()
        for i in ids:
            t = self.vocabulary[i] if 0 <= i < len(self.vocabulary) else "<unk>"
            if t == "<nl>":
                flush()
            elif t == "<indent>":
                depth += 1
            elif t == "<dedent>":
                depth = max(0, depth - 1)
            else:
                line.append({"<num>": "0", "<str>": "'…'"}.get(t, t))
        flush()
        return "\n".join(words)


def _join(tokens):
    """Tokens of one line as source, spaced as a person would: no space before closing brackets,
    dots, commas and colons, none after opening brackets and dots, and none before a call's or
    subscript's opening bracket."""
    out = ""
    for i, t in enumerate(tokens):
        prev = tokens[i - 1] if i else None
        call = t in ("(", "[") and prev is not None and (prev in (")", "]") or
                                                       (prev.isidentifier() and not keyword.iskeyword(prev)))
        if prev is not None and not (t in (")", "]", "}", ".", ",", ":", ";") or call
                                     or prev in ("(", "[", "{", ".", "~")):
            out += " "
        out += t
    return out
