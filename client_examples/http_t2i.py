"""Text-to-image over HTTP: the flags of grpc_t2i.py, default URL localhost:8000. Every tensor
travels in Triton's binary extension (JSON has no BF16). A request the server refuses is one
line on stderr (status and message) and exit code 1."""

from __future__ import annotations

import tritonclient.http as httpclient
from t2i_common import HTTP_URL, api_headers, build_parser, requested_outputs, run_client, save_result, triton_inputs


def main() -> None:
    args = build_parser(__doc__, HTTP_URL, "http_t2i.py").parse_args()
    client = httpclient.InferenceServerClient(args.url, network_timeout=args.timeout,
                                              connection_timeout=args.timeout)
    inputs = triton_inputs(httpclient, args, binary_data=True)
    result = client.infer(args.model, inputs, outputs=requested_outputs(httpclient, binary_data=True),
                          headers=api_headers(grpc=False))
    save_result(args, result)


if __name__ == "__main__":
    raise SystemExit(run_client(main))
