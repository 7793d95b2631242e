#!/usr/bin/env python3
"""A second client for k3serve's public API, in Python (Debian's python3-grpcio + python3-grpc-tools).

    python3 tools/python/k3serve_client.py --addr 127.0.0.1:50051 --prompt-ids 1,5,77 --max-tokens 8

Stubs are generated from proto/ into a temporary directory at start, so nothing generated is
checked in. Prints the streamed token ids, the finish reason and the usage.
"""
import argparse
import os
import sys
import tempfile

import grpc
from grpc_tools import protoc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_stubs():
    out = tempfile.mkdtemp(prefix="k3serve_py_")
    proto_dir = os.path.join(ROOT, "proto")
    rc = protoc.main(["protoc", f"-I{proto_dir}", f"--python_out={out}", f"--grpc_python_out={out}",
                      os.path.join(proto_dir, "k3serve/v1/inference.proto")])
    if rc != 0:
        sys.exit(f"protoc failed with {rc}")
    sys.path.insert(0, out)
    from k3serve.v1 import inference_pb2, inference_pb2_grpc  # noqa: E402
    return inference_pb2, inference_pb2_grpc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--addr", default="127.0.0.1:50051")
    ap.add_argument("--prompt-ids", required=True)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()

    pb, rpc = load_stubs()
    stub = rpc.InferenceStub(grpc.insecure_channel(args.addr))
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=args.timeout)
    sampling = pb.SamplingParams(ignore_eos=args.ignore_eos)
    if args.temperature is not None:
        sampling.temperature = args.temperature
    if args.seed is not None:
        sampling.seed.value = args.seed
    req = pb.GenerateRequest(model=info.name, prompt_ids=[int(x) for x in args.prompt_ids.split(",")],
                             max_tokens=args.max_tokens, sampling=sampling)
    tokens, finish, usage = [], None, None
    try:
        for resp in stub.Generate(req, timeout=args.timeout):
            tokens.extend(resp.token_ids)
            if resp.finish_reason:
                finish, usage = pb.FinishReason.Name(resp.finish_reason), resp.usage
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print("tokens:", " ".join(str(t) for t in tokens))
    print(f"finish: {finish}; prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
