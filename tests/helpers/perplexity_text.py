"""A fixed text for perplexity checks (written for this repository; public domain). No download:
quantized engines are compared with the bfloat16 one on it."""

TEXT = (
    "The lighthouse keeper rose before dawn, as he had done for thirty years, and climbed the narrow "
    "stair to the lamp room. The sea was grey and quiet, and a thin mist lay over the harbour where the "
    "fishing boats waited for the tide. He trimmed the wick, polished the great lens with a soft cloth, "
    "and wrote the time and the weather in the logbook in his small, careful hand. When the sun came up "
    "he put out the light and went down to the kitchen, where the kettle was already singing on the "
    "stove. His daughter had left a letter on the table. She wrote that the city was loud and crowded, "
    "that the trains ran all night, and that she had found work in a library near the river. She asked "
    "whether the gulls still nested on the old stone wall, and whether he remembered to eat a proper "
    "breakfast. He smiled, because he did not. After breakfast he walked along the cliff path to the "
    "village to buy bread, oil for the lamp, and a newspaper that was always two days old. The baker "
    "asked about the winter storms, and the keeper told him that the barometer had been falling since "
    "Tuesday and that the fishermen should stay in port. In the afternoon he mended a broken shutter, "
    "painted the iron railing where the salt had eaten through, and sat for an hour with a book about "
    "the stars. At dusk he climbed the stair again and lit the lamp, and the beam swept out across the "
    "water, steady and bright, as it had every night for a hundred years. Somewhere beyond the dark a "
    "ship changed its course by a few degrees, and the sailors on deck never knew his name."
)
