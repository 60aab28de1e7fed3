"""Generated gRPC/protobuf code (from protos/ by tools/gen_protos.py); do not edit."""
