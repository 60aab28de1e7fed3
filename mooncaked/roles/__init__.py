"""One module per role: each wires engine/, transfer/, store/ and conductor/ into a gRPC server."""
