"""Text-to-image over gRPC: KV files in, image file out.

    python client_examples/grpc_t2i.py --cond build/tiny/dense/sample_kv/cond_kv.pt \
        --uncond build/tiny/dense/sample_kv/uncond_kv.pt --offset-cond 24 --offset-uncond 7 \
        --size 256 256 --steps 20 --seed 42 --out out.png
"""

from __future__ import annotations

import tritonclient.grpc as grpcclient

from t2i_common import build_parser, request_inputs, save_outputs


def main() -> None:
    args = build_parser(__doc__, "localhost:8001").parse_args()
    inputs = []
    for name, array, datatype in request_inputs(args):
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    outputs = [grpcclient.InferRequestedOutput("IMAGE"), grpcclient.InferRequestedOutput("NEXT_RNG_STATE")]
    client = grpcclient.InferenceServerClient(args.url)
    result = client.infer(args.model, inputs, outputs=outputs, client_timeout=args.timeout)
    save_outputs(args, result.as_numpy("IMAGE")[0], result.as_numpy("NEXT_RNG_STATE"))


if __name__ == "__main__":
    main()
