"""Text-to-image over gRPC: KV files in, image file out.

    python client_examples/grpc_t2i.py --cond build/tiny/dense/sample_kv/cond_kv.pt \
        --uncond build/tiny/dense/sample_kv/uncond_kv.pt --offset-cond 24 --offset-uncond 7 \
        --size 256 256 --steps 20 --seed 42 --out out.png
"""

from __future__ import annotations

import tritonclient.grpc as grpcclient
from t2i_common import build_parser, requested_outputs, save_result, triton_inputs


def main() -> None:
    args = build_parser(__doc__, "localhost:8001").parse_args()
    client = grpcclient.InferenceServerClient(args.url)
    result = client.infer(args.model, triton_inputs(grpcclient, args), outputs=requested_outputs(grpcclient),
                          client_timeout=args.timeout)
    save_result(args, result)


if __name__ == "__main__":
    main()
