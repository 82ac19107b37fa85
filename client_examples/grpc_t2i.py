"""Text-to-image over gRPC: KV files in, image file out. A request the server refuses is one
line on stderr (status and message) and exit code 1."""

from __future__ import annotations

import tritonclient.grpc as grpcclient
from t2i_common import GRPC_URL, api_headers, build_parser, requested_outputs, run_client, save_result, triton_inputs


def main() -> None:
    args = build_parser(__doc__, GRPC_URL, "grpc_t2i.py").parse_args()
    client = grpcclient.InferenceServerClient(args.url)
    result = client.infer(args.model, triton_inputs(grpcclient, args), outputs=requested_outputs(grpcclient),
                          client_timeout=args.timeout, headers=api_headers())
    save_result(args, result)


if __name__ == "__main__":
    raise SystemExit(run_client(main))
