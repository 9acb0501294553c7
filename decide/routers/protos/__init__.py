"""The gRPC contracts decide serves beside its own API, as the routers publish them.

`kv_indexer.proto`: SGLang's KV indexer (`experimental/sgl-kv-indexer/proto/kv_indexer.proto`
in sgl-project/sglang at commit 5782266de03ff6b5771858c5e8fa77b8c49453c0).
`indexer.proto`: llm-d's indexer service (`api/indexerpb/indexer.proto` in
llm-d/llm-d-kv-cache at commit 7be76e119ca50c5700b3bca65a19b6a0218a9b62).
The `*_pb2.py` and `*_pb2_grpc.py` modules are generated from them by `regenerate.py`.
"""
