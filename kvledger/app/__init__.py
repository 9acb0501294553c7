"""The application: the `kvledger` command, which composes the stages (`up`, `demo`,
`config`, the audit queries), and the demo. The only layer that imports the stages."""
