"""Chat templates render exactly as transformers' apply_chat_template renders them."""

from __future__ import annotations

import json

import pytest

from pdserve.router.chat import ChatTemplate, ChatTemplateError

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "天空为什么是蓝色的？"},
        {"role": "assistant", "content": "Rayleigh."},
        {"role": "user", "content": "And at sunset? 🌅"},
    ],
]


def _with_template(folder, template):
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    return folder


@pytest.fixture
def chatml_dir(tmp_path, embedded_dir):
    for f in embedded_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    return _with_template(tmp_path, CHATML)


@pytest.mark.parametrize("which", ["embedded", "chatml"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_render_equals_transformers(request, which, generation_prompt, embedded_dir):
    from transformers import AutoTokenizer

    folder = embedded_dir if which == "embedded" else request.getfixturevalue("chatml_dir")
    ours = ChatTemplate.from_folder(folder)
    hf = AutoTokenizer.from_pretrained(str(folder))
    for messages in CONVERSATIONS:
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        assert ours.render(messages, generation_prompt) == want


def test_chat_template_jinja_file_wins(chatml_dir):
    (chatml_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] | upper }}")
    assert ChatTemplate.from_folder(chatml_dir).render(CONVERSATIONS[0]) == "WHAT IS THE CAPITAL OF FRANCE?"


def test_no_template_and_refusing_templates_raise(tmp_path, stories_dir, chatml_dir):
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTemplate.from_folder(stories_dir).render(CONVERSATIONS[0])
    _with_template(chatml_dir, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ChatTemplate.from_folder(chatml_dir).render(CONVERSATIONS[0])


def test_the_sandbox_refuses_python_internals(chatml_dir):
    _with_template(chatml_dir, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        ChatTemplate.from_folder(chatml_dir).render(CONVERSATIONS[0])
