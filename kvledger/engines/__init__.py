"""What runs beside an engine: vLLM's KV-event publishing protocol (`publisher.py`), written once, and the
TensorRT-LLM forwarder that speaks it for an engine that does not (`trtllm_forwarder.py`). The simulated
engines (`kvledger.sim`) publish through it too. Like them, it imports the core and the engine formats
ingest reads (`ingest/wire.py`'s framing, `ingest/endpoints.py`'s port per rank), nothing else of a stage."""
