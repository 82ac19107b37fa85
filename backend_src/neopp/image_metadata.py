"""The marking every delivered picture carries: a model made it.

Every PNG, JPEG and WebP this server writes (final images and previews, from every model and
from the in-process runners) holds an XMP packet with the IPTC digital source type
``trainedAlgorithmicMedia``, the machine-readable form image tools and platforms read to label
generated pictures. It is the same packet in every file, so a picture's bytes stay the same
across models, transports and the in-process path, as the tests require.
"""

from __future__ import annotations

from typing import Any

from PIL import PngImagePlugin

DIGITAL_SOURCE_TYPE = "http://cv.iptc.org/newscodes/digitalsourcetype/trainedAlgorithmicMedia"
XMP_PACKET = (f'<?xpacket begin="\ufeff" id="W5M0MpCehiHzreSzNTczkc9d"?>\n'
              f'<x:xmpmeta xmlns:x="adobe:ns:meta/">\n'
              f' <rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">\n'
              f'  <rdf:Description rdf:about=""\n'
              f'    xmlns:Iptc4xmpExt="http://iptc.org/std/Iptc4xmpExt/2008-02-29/"\n'
              f'    Iptc4xmpExt:DigitalSourceType="{DIGITAL_SOURCE_TYPE}"/>\n'
              f' </rdf:RDF>\n'
              f'</x:xmpmeta>\n'
              f'<?xpacket end="w"?>')


def save_options(pil_format: str) -> dict[str, Any]:
    """Pillow's save arguments that write the marking into a file of ``pil_format``."""
    if pil_format == "PNG":
        info = PngImagePlugin.PngInfo()
        info.add_itxt("XML:com.adobe.xmp", XMP_PACKET, zip=False)
        return {"pnginfo": info}
    return {"xmp": XMP_PACKET.encode()}
