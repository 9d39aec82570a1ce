"""The model registry: the models deployments may name, where their files are, and what they are.

``sources`` resolves a folder under a model root or a Hugging Face id; ``inspect`` reads a folder's
family, size and tokenizer without loading weights; ``vocabulary`` decides whether a drafter and a
target tokenize alike; ``service`` registers, resolves and deletes; ``location`` is what a worker or
server is handed to load a model (a folder or artifact URI plus the digests to verify it by).
"""
