"""The routers' index APIs over the index: Dynamo's (HTTP), SGLang's and llm-d's (gRPC, from their own protos)."""
