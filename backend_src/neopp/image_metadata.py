"""What every delivered picture says of itself: a model made it, and how.

Every PNG, JPEG and WebP this server writes (final images and previews, from every model and
from the in-process runners) holds an XMP packet with the IPTC digital source type
``trainedAlgorithmicMedia``, the machine-readable form image tools and platforms read to label
generated pictures. A picture a model served also carries its record
(:mod:`neopp.contract.picture_record`): in a PNG ``iTXt`` chunk of its own, in JPEG and WebP as an
attribute of the XMP packet. A record too long for the reader's bound, or for a JPEG's 64 KiB XMP
segment, leaves its prompts out and says so.
"""

from __future__ import annotations

import json
from typing import Any

from PIL import PngImagePlugin

from .contract.picture_record import MAX_RECORD_BYTES, RECORD_KEY, xml_attribute

DIGITAL_SOURCE_TYPE = "http://cv.iptc.org/newscodes/digitalsourcetype/trainedAlgorithmicMedia"
RECORD_NAMESPACE = "urn:neopp:record:1/"
JPEG_XMP_ROOM = 65_000  # an APP1 segment's 65,533 bytes less the XMP signature, with margin
PROMPTS = ("prompt", "negative_prompt")


def xmp_packet(record: str | None = None) -> str:
    """The XMP packet: the digital source type, and the record as ``neopp:Record`` when given."""
    extra = "" if record is None else (f'\n    xmlns:neopp="{RECORD_NAMESPACE}"\n'
                                       f'    neopp:Record="{xml_attribute(_ascii(record))}"')
    return (f'<?xpacket begin="\ufeff" id="W5M0MpCehiHzreSzNTczkc9d"?>\n'
            f'<x:xmpmeta xmlns:x="adobe:ns:meta/">\n'
            f' <rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">\n'
            f'  <rdf:Description rdf:about=""\n'
            f'    xmlns:Iptc4xmpExt="http://iptc.org/std/Iptc4xmpExt/2008-02-29/"\n'
            f'    Iptc4xmpExt:DigitalSourceType="{DIGITAL_SOURCE_TYPE}"{extra}/>\n'
            f' </rdf:RDF>\n'
            f'</x:xmpmeta>\n'
            f'<?xpacket end="w"?>')


XMP_PACKET = xmp_packet()


def _ascii(record: str) -> str:
    """The record with every character past ASCII as a JSON escape: XML allows no character of
    some code points (U+FFFE, U+FFFF) that a prompt may hold, and JSON reads it back the same."""
    return json.dumps(json.loads(record), separators=(",", ":"))


def save_options(pil_format: str, record: str | None = None) -> dict[str, Any]:
    """Pillow's save arguments that write the marking, and the record when given, into a file
    of ``pil_format``."""
    if pil_format == "PNG":
        info = PngImagePlugin.PngInfo()
        info.add_itxt("XML:com.adobe.xmp", XMP_PACKET, zip=False)
        if record is not None:
            info.add_itxt(RECORD_KEY, stored_record(pil_format, record), zip=False)
        return {"pnginfo": info}
    return {"xmp": xmp_packet(None if record is None else stored_record(pil_format, record)).encode()}


def stored_record(pil_format: str, record: str) -> str:
    """The record as a file of ``pil_format`` holds it: without its prompts when it would be too
    long for the reader's bound (or a JPEG's XMP segment), so the server never writes a record its
    reader refuses, and a signature covers what the file says."""
    if pil_format == "PNG":
        fits = len(record.encode()) <= MAX_RECORD_BYTES
    else:
        fits = len(_ascii(record)) <= MAX_RECORD_BYTES and \
            (pil_format != "JPEG" or len(xmp_packet(record).encode()) <= JPEG_XMP_ROOM)
    return record if fits else _without_prompts(record)


def _without_prompts(record: str) -> str:
    """The record with its prompts left out (the file has no room for them): their fields say so
    instead of holding the text."""
    doc = json.loads(record)
    for key in PROMPTS:
        if doc.get(key) is not None:
            doc[key] = None
    doc["prompts_omitted"] = True
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
