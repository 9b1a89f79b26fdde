"""The event contract, the bottom layer: record and topic names, the Avro codec, the schema registry, what a valid
input is, and the settings every layer reads."""
