"""What the stages share that touches the world: NATS connections and streams, the embedded
nats-server, the HTTP front, process lifetime and signals, and the data folders. The core
(`kvledger/` itself) imports nothing from here."""
