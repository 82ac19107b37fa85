"""Text-to-image over HTTP (binary tensors, needed for BF16): KV files in, image file out.

    python client_examples/http_t2i.py --cond build/tiny/dense/sample_kv/cond_kv.pt \
        --uncond build/tiny/dense/sample_kv/uncond_kv.pt --offset-cond 24 --offset-uncond 7 \
        --size 256 256 --steps 20 --seed 42 --out out.png
"""

from __future__ import annotations

import tritonclient.http as httpclient

from t2i_common import build_parser, request_inputs, save_outputs


def main() -> None:
    args = build_parser(__doc__, "localhost:8000").parse_args()
    inputs = []
    for name, array, datatype in request_inputs(args):
        tensor = httpclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array, binary_data=True)
        inputs.append(tensor)
    outputs = [httpclient.InferRequestedOutput("IMAGE", binary_data=True),
               httpclient.InferRequestedOutput("NEXT_RNG_STATE", binary_data=True)]
    client = httpclient.InferenceServerClient(args.url, network_timeout=args.timeout,
                                              connection_timeout=args.timeout)
    result = client.infer(args.model, inputs, outputs=outputs)
    save_outputs(args, result.as_numpy("IMAGE")[0], result.as_numpy("NEXT_RNG_STATE"))


if __name__ == "__main__":
    main()
