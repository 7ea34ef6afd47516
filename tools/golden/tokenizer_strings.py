"""Deterministic test strings for tokenizer fixtures: multilingual prose, code, emoji (ZWJ, skin
tones, flags), whitespace runs, CRLF, digits, contractions, added tokens (whole and half-written),
NFD text, control and zero-width characters. make_strings(n, seed) always returns the same list."""
import random
import unicodedata

PROSE = [
    "The quick brown fox jumps over the lazy dog.",
    "It's 5 o'clock somewhere, isn't it? They'll say we'd've known.",
    "Der Bär läuft über die Straße und frißt Äpfel. Größe: 1,75 m.",
    "Les élèves ont réussi l'examen à Noël ; c'était très façile.",
    "El niño pidió una piña en el año 2024, ¿verdad? ¡Sí!",
    "Москва — столица России. Съешь же ещё этих мягких французских булок.",
    "Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο.",
    "我们今天去公园散步，天气非常好。机器学习是人工智能的一个分支。",
    "東京は日本の首都です。ひらがなとカタカナ、そして漢字を使います。",
    "한국어는 아름다운 언어입니다. 안녕하세요, 만나서 반갑습니다!",
    "مرحبا بالعالم. اللغة العربية جميلة جدا.",
    "שלום עולם! עברית נכתבת מימין לשמאל.",
    "नमस्ते दुनिया। हिन्दी भाषा देवनागरी लिपि में लिखी जाती है।",
    "ภาษาไทยไม่มีการเว้นวรรคระหว่างคำ สวัสดีครับ",
    "Tiếng Việt có nhiều dấu thanh: à, á, ả, ã, ạ.",
    "İstanbul'da ılık bir gün; IĞDIR ve ıspanak.",
    "Ελληνικά: ΣΊΣΥΦΟΣ, σίσυφος. Ὀδυσσεύς.",
    "Kiswahili ni lugha ya Afrika Mashariki.",
    "Ἐν ἀρχῇ ἦν ὁ λόγος, καὶ ὁ λόγος ἦν πρὸς τὸν θεόν.",
    "ᐃᓄᒃᑎᑐᑦ ᑎᑎᕋᐅᓯᖅ",
    "Ⅻ ½ ² ﬁ ﬀ ㎏ ℃ Ｆｕｌｌｗｉｄｔｈ ＡＢＣ １２３",
]

CODE = [
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}}',
    "#include <stdio.h>\nint main(void) { printf(\"hi\\n\"); return 0; }\r\n",
    "SELECT * FROM users WHERE id = 42 AND name LIKE '%bob%';",
    "    if self.x is not None:\n        self.x += 1\n\n\n",
    "const re = /^[a-z]+$/i; let s = `template ${x}`;",
    "<div class=\"main\">&nbsp;Hello &amp; welcome</div>",
    "x=1;y=2;;z=x+y==3&&!false||~0>>1<<2",
    "$ ls -la | grep '.py' > out.txt 2>&1",
]

EMOJI = [
    "👨‍👩‍👧‍👦", "👩🏽‍💻", "🧑🏿‍🚀", "👍🏻👍🏼👍🏽👍🏾👍🏿", "🇺🇸🇨🇳🇯🇵🇩🇪🇫🇷", "🏳️‍🌈", "🏴‍☠️",
    "❤️‍🔥", "🙂🙃😀", "✊🏾", "🤷‍♀️", "1️⃣#️⃣", "🏴󠁧󠁢󠁳󠁣󠁴󠁿", "☺︎", "😀😃😄😁",
]

SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|vision_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|repo_name|>", "<think>", "</think>",
    "<tool_response>", "</tool_response>",
]
HALF = ["<|im_sta", "<|im_end", "|im_end|>", "<|endoftext", "<think", "</think", "think>", "<|", "|>",
        "<<|im_end|>>", "<|im_start|><|im_end|>", "<tool_call", "<|endoftext|>|>", "< think>"]

CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'M", "'LL", "'D",
                "'ſ", "’s", "''", "'"]

CONTROL = ["\x00", "\x01", "\x07", "\x1b", "\x7f", "\x85", "\u00a0", "\u200b", "\u200c", "\u200d", "\u200e",
           "\ufeff", "\u2028", "\u2029", "\u3000", "\u202f", "\u180e", "\ufffd", "\uffff", "\U0001d400",
           "\U000e0001", "\U0010fffd", "\u0301", "\u0308\u0301", "\u1100\u1161\u11a8"]

WHITESPACE = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", "\r\n\r\n", " \n", "\n ", " \t \n",
              "        ", "\r", "\x0b", "\x0c", " \r\n  "]

BLOCKS = [(0x20, 0x7e), (0xa0, 0x24f), (0x300, 0x36f), (0x370, 0x3ff), (0x400, 0x4ff), (0x590, 0x5ff),
          (0x600, 0x6ff), (0x900, 0x97f), (0xe00, 0xe7f), (0x1100, 0x11ff), (0x1e00, 0x1eff),
          (0x2000, 0x206f), (0x2100, 0x214f), (0x2190, 0x21ff), (0x2460, 0x24ff), (0x3000, 0x30ff),
          (0x4e00, 0x4fff), (0xac00, 0xad00), (0xfb00, 0xfb4f), (0xfe00, 0xfe0f), (0xff00, 0xffef),
          (0x1f300, 0x1f64f), (0x1f900, 0x1f9ff), (0x1d400, 0x1d7ff)]


def rand_unicode(rng, n):
    out = []
    while len(out) < n:
        lo, hi = rng.choice(BLOCKS)
        cp = rng.randint(lo, hi)
        if 0xd800 <= cp < 0xe000:
            continue
        out.append(chr(cp))
    return "".join(out)


def digits(rng):
    k = rng.choice([1, 2, 3, 5, 8, 13, 30, 100])
    s = "".join(rng.choice("0123456789") for _ in range(k))
    return rng.choice([s, f"{int(s):,}" if k < 30 else s, s + "." + s[:3], "-" + s, "٣٤٥", "１２３", "½"])


def fragment(rng, with_special):
    kind = rng.randrange(12)
    if kind == 0:
        return rng.choice(PROSE)
    if kind == 1:
        return rng.choice(CODE)
    if kind == 2:
        return rng.choice(EMOJI)
    if kind == 3:
        return rng.choice(WHITESPACE)
    if kind == 4:
        return digits(rng)
    if kind == 5:
        w = rng.choice(["I", "you", "WE", "they", "It", "she", "HE", "don", "can", "won"])
        return w + rng.choice(CONTRACTIONS) + rng.choice(["", " ", "s", "x"])
    if kind == 6 and with_special:
        return rng.choice(SPECIAL + HALF)
    if kind == 7:
        return unicodedata.normalize("NFD", rng.choice(PROSE))
    if kind == 8:
        return rng.choice(CONTROL)
    if kind == 9:
        return rand_unicode(rng, rng.randint(1, 12))
    if kind == 10:
        words = rng.choice(PROSE).split()
        return " ".join(rng.sample(words, min(len(words), rng.randint(1, 5))))
    return rng.choice(["a", "A", ".", ",", "!?", "...", "—", "’", "\"", "(", ")", "[", "]", "_", "-", "--",
                       "==", "//", "::", "@", "#", "http://example.com/a?b=c&d=e", "e.g.", "U.S.A."])


def make_strings(n, seed, with_special=True):
    """n strings; the first ones are fixed edge cases, the rest random concatenations of fragments."""
    rng = random.Random(seed)
    fixed = ["", " ", "  ", "\n", "\r\n", "\t", "a", "Hello world", "hello  world", "   leading", "trailing   ",
             "x \n y", "a\r\n\r\nb", "1234567890" * 5, "I'M HERE, WE'LL GO, YOU'RE 'S", "'s's's", "ſ 'ſ",
             "n\u0303o", unicodedata.normalize("NFD", "Ça, éèê, ñ, 한국어"), "\u1100\u1161\u11a8",
             "🇺🇸🇬🇧", "👩‍❤️‍💋‍👨"]
    if with_special:
        fixed += SPECIAL + HALF + ["a<|im_end|>b", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                                   "x <think>\n\n</think>\n\ny", "<|endoftext|><|endoftext|>",
                                   "\u0301<|im_end|>\u0301", "e<|im_end|>\u0301"]
    out = list(fixed)
    while len(out) < n:
        k = rng.choice([1, 1, 2, 3, 4, 6, 10])
        out.append("".join(fragment(rng, with_special) for _ in range(k)))
    return out[:n]
