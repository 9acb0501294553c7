"""The decision service: NATS and HTTP, batching, recording, shadow and in-flight decisions, stream checks."""
