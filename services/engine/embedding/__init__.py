"""Embedding models (BERT-family encoders with sentence-transformers pooling), kept apart from
the generation core: no KV cache, no sampling, one forward per batch. `EmbeddingEngine` is the
offline batch encoder, `AsyncEmbeddingEngine` batches concurrent requests on its own thread.
"""
