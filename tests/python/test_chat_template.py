"""troupe's chat-template formatters against jinja2 rendering the real template texts.

The reference is jinja2 configured as Hugging Face's apply_chat_template configures it
(ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, raise_exception, bos_token,
eos_token). troupe_chat_template_tool renders the same conversations; the outputs must agree
byte for byte, and where jinja raises, troupe must reject the conversation too.
"""

import json
import os
import pathlib
import random
import subprocess

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "chat_templates"
MODEL = ROOT / "models" / "default.gguf"

# fixture -> (family, bos text, eos text)
TEMPLATES = {
    "chatml_openhermes": ("chatml", "<s>", "<|im_end|>"),
    "chatml_qwen2": ("chatml", "<|endoftext|>", "<|im_end|>"),
    "chatml_smollm2": ("chatml", "<|im_start|>", "<|im_end|>"),
    "llama3": ("llama3", "<|begin_of_text|>", "<|eot_id|>"),
    "llama3_original": ("llama3", "<|begin_of_text|>", "<|end_of_text|>"),
    "gemma3": ("gemma", "<bos>", "<eos>"),
    "gemma2": ("gemma", "<bos>", "<eos>"),
    "mistral_v01": ("mistral", "<s>", "</s>"),
    "mistral_v02": ("mistral", "<s>", "</s>"),
    "mistral_v02_system": ("mistral", "<s>", "</s>"),
}
# chat_template::from_name(family) renders as this fixture does.
CANONICAL = {"chatml": "chatml_openhermes", "llama3": "llama3", "gemma": "gemma3",
             "mistral": "mistral_v02_system"}

CONTENTS = [
    "Hello",
    "",
    "  padded both sides  ",
    "\u3000ideographic and no-break\u00a0spaces\u2009",
    "line one\nline two\n",
    "\n\n",
    "emoji 🦀🎉 and 日本語のテキスト",
    "e\u0301 combining, ÅÄÖ",
    "quotes ' \" and \\ backslashes",
    "{{ not jinja }} {% raw %} {# no #}",
    "<|im_end|> <end_of_turn> [/INST] look like markup",
    "\t\ttabs\t",
    "\u200bzero-width is not whitespace\u200b",
    "\x1c\x1dseparators\x1e\x1f and \x85NEL\x85",
    "\u2028line separator\u2029",
    " ",
]


def tool_path():
    build = os.environ.get("TROUPE_BUILD_DIR")
    if not build:
        pytest.skip("TROUPE_BUILD_DIR is not set (run through ctest)")
    path = pathlib.Path(build) / "tests" / "tools" / "troupe_chat_template_tool"
    assert path.exists(), f"{path} is not built"
    return path


def run_tool(items):
    out = subprocess.run([str(tool_path())], input=json.dumps(items).encode(), capture_output=True,
                         check=True, timeout=120)
    results = json.loads(out.stdout.decode())
    assert len(results) == len(items)
    return results


class JinjaReference:
    """Renders as transformers' apply_chat_template does."""

    def __init__(self):
        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        self.env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                 extensions=[jinja2.ext.loopcontrols])
        self.env.globals["raise_exception"] = raise_exception

    def render(self, source, bos, eos, messages, add_generation_prompt):
        """The rendered text, or None when the template raises."""
        try:
            return self.env.from_string(source).render(
                messages=messages, bos_token=bos, eos_token=eos,
                add_generation_prompt=add_generation_prompt)
        except jinja2.exceptions.TemplateError:
            return None


def conversations(seed=20240601, n_random=120):
    """Valid and invalid conversations with roles system/user/assistant."""
    rng = random.Random(seed)
    out = []

    def msg(role):
        if rng.random() < 0.2:
            text = "".join(rng.choice(" \n\tab€😀\u3000\u00a0xyz") for _ in range(rng.randint(0, 12)))
        else:
            text = rng.choice(CONTENTS)
        return {"role": role, "content": text}

    for _ in range(n_random):
        convo = []
        if rng.random() < 0.5:
            convo.append(msg("system"))
        for turn in range(rng.randint(1, 5)):
            convo.append(msg("user" if turn % 2 == 0 else "assistant"))
        out.append(convo)
    # Orders some templates reject (and single messages of each role).
    out += [
        [msg("assistant")],
        [msg("system")],
        [msg("user"), msg("user")],
        [msg("user"), msg("assistant"), msg("assistant")],
        [msg("system"), msg("assistant"), msg("user")],
        [msg("user"), msg("system"), msg("user")],
        [msg("user"), msg("assistant"), msg("system")],
        [msg("system"), msg("system"), msg("user")],
        [msg("system"), msg("user"), msg("system")],
    ]
    return out


@pytest.fixture(scope="module")
def reference():
    return JinjaReference()


def fixture_text(name):
    return (FIXTURES / f"{name}.jinja").read_text(encoding="utf-8")


def compare(reference, source, bos, eos, convos, family=None):
    """Renders every conversation both ways, with and without the generation prompt."""
    items, expected = [], []
    for convo in convos:
        for gen in (False, True):
            item = {"bos": bos, "eos": eos, "messages": convo, "add_generation_prompt": gen}
            item.update({"family": family} if family else {"template": source})
            items.append(item)
            expected.append(reference.render(source, bos, eos, convo, gen))
    results = run_tool(items)
    n_rejected = 0
    for item, want, got in zip(items, expected, results):
        assert got["family"] is not None, "template not recognized"
        if want is None:
            n_rejected += 1
            assert "error" in got, f"jinja rejects {item['messages']}, troupe rendered {got.get('text')!r}"
        else:
            assert "text" in got, f"troupe rejected {item['messages']}: {got.get('error')}"
            assert got["text"] == want, f"messages {item['messages']} gen={item['add_generation_prompt']}"
    return n_rejected


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_fixture_matches_jinja(reference, name):
    family, bos, eos = TEMPLATES[name]
    source = fixture_text(name)
    (got,) = run_tool([{"template": source, "bos": bos, "eos": eos}])
    assert got["family"] == family
    n_rejected = compare(reference, source, bos, eos, conversations())
    if family in ("gemma", "mistral"):
        assert n_rejected > 0  # the order checks were exercised


@pytest.mark.parametrize("family", sorted(CANONICAL))
def test_family_by_name_matches_its_canonical_template(reference, family):
    _, bos, eos = TEMPLATES[CANONICAL[family]]
    compare(reference, fixture_text(CANONICAL[family]), bos, eos, conversations(seed=7, n_random=40),
            family=family)


def test_real_smollm2_template_from_the_gguf(reference):
    if not MODEL.exists():
        pytest.skip(f"{MODEL} not present")
    from gguf import GGUFReader

    fields = GGUFReader(str(MODEL)).fields
    source = fields["tokenizer.chat_template"].contents()
    tokens = fields["tokenizer.ggml.tokens"].contents()
    bos = tokens[fields["tokenizer.ggml.bos_token_id"].contents()]
    eos = tokens[fields["tokenizer.ggml.eos_token_id"].contents()]
    assert source == fixture_text("chatml_smollm2")
    (got,) = run_tool([{"template": source, "bos": bos, "eos": eos}])
    assert got["family"] == "chatml"
    compare(reference, source, bos, eos, conversations(seed=3))
    # The default system prompt appears exactly when the first message is not a system one.
    text = reference.render(source, bos, eos, [{"role": "user", "content": "Hi"}], True)
    assert "You are a helpful AI assistant named SmolLM" in text


def test_rejects_empty_conversations_and_unknown_roles():
    items = []
    for name, (_, bos, eos) in TEMPLATES.items():
        source = fixture_text(name)
        items.append({"template": source, "bos": bos, "eos": eos, "messages": []})
        for role in ("tool", "developer", "User", ""):
            items.append({"template": source, "bos": bos, "eos": eos,
                          "messages": [{"role": "user", "content": "a"}, {"role": role, "content": "b"}]})
    for got in run_tool(items):
        assert got["family"] is not None
        assert "error" in got and "text" not in got


MUTATIONS = [
    # (description, old, new): applied where `old` occurs.
    ("literal text between tags", "{% endfor %}", "{% endfor %}!"),
    ("changed newline", "'\\n'", "'\\n\\n'"),
    ("changed end marker", "<|im_end|>", "<|im_end|> "),
    ("changed header", "<|end_header_id|>", "<|end_header_id|>:"),
    ("no trim", " | trim", ""),
    ("changed turn marker", "<end_of_turn>", "<end_of_turn>\n"),
    ("model role", "'model'", "'assistant'"),
    ("inst spacing", "' [/INST]'", "'[/INST]'"),
    ("eos position", "eos_token", "bos_token"),
    ("condition", "loop.first", "loop.last"),
    ("generation prompt", "add_generation_prompt", "not add_generation_prompt"),
    ("modulo", "% 2 == 0", "% 2 == 1"),
    ("system prefix", "'\\n\\n'", "'\\n'"),
    ("tools", "{% for message in messages %}", "{% if tools %}x{% endif %}{% for message in messages %}"),
    ("newline after an expression", "}}{% endfor %}", "}}\n{% endfor %}"),
]

HARMLESS = [
    # Formatting that Jinja renders identically: must stay recognized.
    ("whitespace control", "{% endfor %}", "{%- endfor -%}"),
    ("double quotes", "'<|im_start|>'", '"<|im_start|>"'),
    ("operator spacing", " + ", "+"),
    ("attribute syntax", "message['role']", "message.role"),
    ("comment", "{% endfor %}", "{% endfor %}{# a comment #}"),
    ("trailing newline", None, "\n"),
    ("newline after a block", "{% endfor %}", "{% endfor %}\n"),
    ("indented block", "{% if add_generation_prompt %}", "\n    {% if add_generation_prompt %}"),
]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_altered_templates_are_rejected_or_exact(reference, name):
    """A template changed in any way that matters is either not recognized or still rendered
    exactly; formatting-only changes stay recognized."""
    family, bos, eos = TEMPLATES[name]
    base = fixture_text(name)
    convos = conversations(seed=11, n_random=25)
    for desc, old, new in MUTATIONS + HARMLESS:
        if old is None:
            source = base + new
        elif old in base:
            source = base.replace(old, new)
        else:
            continue
        (got,) = run_tool([{"template": source, "bos": bos, "eos": eos}])
        if (desc, old, new) in HARMLESS:
            assert got["family"] == family, f"{desc}: no longer recognized"
        if got["family"] is not None:
            compare(reference, source, bos, eos, convos)


def test_unrelated_templates_are_not_recognized():
    items = [{"template": t, "bos": "<s>", "eos": "</s>"} for t in [
        "",
        "INVALID TEMPLATE",
        "{% for message in messages %}{{ message['content'] }}{% endfor %}",
        # Llama-2 chat.
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
        "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}"
        "{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
        "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
        "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
        "{% endfor %}",
        # ChatML without the final newline after <|im_end|> on the last turn.
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']}}"
        "{% if loop.last %}{{ '<|im_end|>'}}{% else %}{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}",
        # Unterminated tag.
        "{% for message in messages %}{{ message['content'] ",
    ]]
    for got in run_tool(items):
        assert got["family"] is None
