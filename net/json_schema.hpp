// JSON Schema -> engine::json_grammar, for response_format {"type": "json_schema"}.
//
// Supported (the subset llama.cpp's and vLLM's servers cover for structured output):
//   type (one or a list), properties (emitted in the schema's order), required,
//   additionalProperties (absent or false: none; true or a schema: extra members, never under a
//   declared name), items, minItems, maxItems, minLength, maxLength, pattern (anchored "^...$",
//   the regular-expression subset of engine/code_nfa.hpp; not together with min/maxLength),
//   format date, time, date-time and uuid (as patterns), enum, const, anyOf, oneOf (as anyOf:
//   exclusivity is not enforced), allOf of one schema, $ref to "#" or a path inside the
//   document ("#/$defs/X", "#/definitions/X"), recursion included; true / {} (any value).
//   {"type": "object"} with neither properties nor additionalProperties: any object.
// Refused with the keyword named: minimum / maximum / exclusive* / multipleOf, the other object
//   and array keywords (patternProperties, prefixItems, uniqueItems, ...), other formats, not,
//   if/then/else, allOf of several schemas, remote $refs. Unknown keywords (annotations such as
//   title, description, default, examples) are ignored.
#pragma once

#include <memory>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "engine/json_grammar.hpp"

namespace troupe::net {

struct schema_error : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

/// Throws schema_error naming the unsupported or malformed part.
std::shared_ptr<const engine::json_grammar> compile_json_schema(const nlohmann::ordered_json& schema);

}  // namespace troupe::net
