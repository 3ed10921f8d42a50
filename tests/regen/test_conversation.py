"""Regeneration of one conversation where the target's chat template refuses the prompt.

A template that raises (Gemma's "System role not supported", Mistral's alternation check,
both through `raise_exception`) used to crash the whole regen job from the local prompt
count. It is now this row's reason (`template_render_error`, skipped), and no request is
sent: the client points at a port nothing listens on.
"""

from __future__ import annotations

import asyncio
import os
import shutil

from services.conductor.processes import free_port
from services.regen.client import ChatClient
from services.regen.conversation import SKIPPED, Regenerator
from services.regen.stage import prompt_counter
from shared.recipe import resolve_recipe
from shared.records import Conversation

os.environ.setdefault("HF_HUB_OFFLINE", "1")

NO_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_template_that_raises_skips_the_row(tmp_path, smollm2_path):
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_path / name, tok_dir / name)
    (tok_dir / "chat_template.jinja").write_text(NO_SYSTEM)
    recipe = resolve_recipe(
        {
            "name": "regen-template",
            "target": {"path": str(smollm2_path), "tokenizer": str(tok_dir)},
            "datasets": [{"path": "/d"}],
        }
    )
    count = prompt_counter(recipe)
    user = {"role": "user", "content": "Hi"}
    assert count([user], None) > 0  # a prompt without a system turn renders
    row = Conversation.model_validate(
        {
            "id": "d:0",
            "source": "d",
            "messages": [
                {"role": "system", "content": "Be brief."},
                user,
                {"role": "assistant", "content": "Hello"},
            ],
        }
    )
    client = ChatClient(f"http://127.0.0.1:{free_port()}", "m", {}, {}, 5, 0)
    regen = Regenerator(client, count, max_turns=2, max_prompt_tokens=1000)
    out = asyncio.run(regen.run(row))
    assert (out.status, out.reason) == (SKIPPED, "template_render_error")
    assert "System role not supported" in out.detail
