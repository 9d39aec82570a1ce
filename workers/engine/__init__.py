"""The reference speculative-decoding engine: a leaf package that imports only torch, tokenizers and
safetensors, never anything else from the project (so training, serving and benches share it).

Modules: `model` (the Llama, Qwen2, Qwen3 and Mistral decoders + rollback-able KV cache),
`tokenizer` (byte-level BPE), `hf_io` (Hugging Face folder save/load), `proposers` (draft model,
n-gram, predicted output), `verifier` (greedy and rejection-sampling verification), `decoder`
(`SpeculativeDecoder`), `stop_strings` (the OpenAI `stop` values a request may carry) and `metrics`
(per-request records in native and Fireworks shape).
"""
