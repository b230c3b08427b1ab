#include "net/json_schema.hpp"

#include <map>
#include <set>
#include <string>

namespace troupe::net {

namespace {

using json = nlohmann::ordered_json;
using engine::json_grammar;
using engine::json_node;

const std::set<std::string>& unsupported_keywords() {
  static const std::set<std::string> k{"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                                       "multipleOf", "minProperties", "maxProperties", "patternProperties", "propertyNames",
                                       "dependentRequired", "dependentSchemas", "dependencies", "if", "then", "else", "not",
                                       "uniqueItems", "contains", "minContains", "maxContains", "prefixItems",
                                       "unevaluatedProperties", "unevaluatedItems", "contentEncoding", "contentMediaType",
                                       "$dynamicRef", "$recursiveRef"};
  return k;
}

// JSON Schema formats as patterns (RFC 3339 date, time with optional fraction and zone, both
// joined by T; RFC 4122 text form of a UUID), as llama.cpp's converter has them.
const std::map<std::string, std::string>& format_patterns() {
  static const std::string date = "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])";
  static const std::string time = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,3})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])";
  static const std::map<std::string, std::string> m{
      {"date", "^" + date + "$"},
      {"time", "^" + time + "$"},
      {"date-time", "^" + date + "T" + time + "$"},
      {"uuid", "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"}};
  return m;
}

int64_t non_negative(const json& s, const char* key, const std::string& at) {
  const auto& v = s.at(key);
  if (!v.is_number_integer() || v.get<int64_t>() < 0)
    throw schema_error("'" + std::string(key) + "' at " + at + " must be a non-negative integer");
  return v.get<int64_t>();
}

class compiler {
 public:
  explicit compiler(const json& root) : root_(root), g_(std::make_shared<json_grammar>()) {}

  std::shared_ptr<const json_grammar> run() {
    g_->set_root(compile(root_, "#"));
    if (auto err = g_->finalize(); !err.empty()) throw schema_error("the schema cannot be used: " + err);
    return g_;
  }

 private:
  int32_t compile(const json& s, const std::string& at) {
    if (++depth_ > 256) throw schema_error("the schema nests too deeply (at " + at + ")");
    struct guard {
      int& d;
      ~guard() { --d; }
    } g{depth_};
    if (s.is_boolean()) {
      if (!s.get<bool>()) throw schema_error("the schema at " + at + " is false: no value satisfies it");
      return json_grammar::any;
    }
    if (!s.is_object()) throw schema_error("the schema at " + at + " must be an object or a boolean");
    for (const auto& [k, v] : s.items())
      if (unsupported_keywords().count(k)) throw schema_error("'" + k + "' (at " + at + ") is not supported in a response_format schema");
    if (const auto r = s.find("$ref"); r != s.end()) return reference(*r, at);
    if (const auto a = s.find("allOf"); a != s.end()) {
      if (!a->is_array() || a->size() != 1)
        throw schema_error("'allOf' (at " + at + ") is supported with exactly one schema");
      return compile((*a)[0], at + "/allOf/0");
    }
    for (const char* key : {"anyOf", "oneOf"}) {
      if (const auto a = s.find(key); a != s.end()) {
        if (!a->is_array() || a->empty()) throw schema_error("'" + std::string(key) + "' (at " + at + ") must be a non-empty array");
        json_node u;
        u.k = json_node::kind::any_of;
        for (size_t i = 0; i < a->size(); ++i) u.branches.push_back(compile((*a)[i], at + "/" + key + "/" + std::to_string(i)));
        return g_->add(std::move(u));
      }
    }
    if (const auto c = s.find("const"); c != s.end()) {
      json_node l;
      l.k = json_node::kind::literal;
      l.literals.push_back(c->dump());
      return g_->add(std::move(l));
    }
    if (const auto e = s.find("enum"); e != s.end()) {
      if (!e->is_array() || e->empty()) throw schema_error("'enum' (at " + at + ") must be a non-empty array");
      json_node l;
      l.k = json_node::kind::literal;
      for (const auto& v : *e) l.literals.push_back(v.dump());
      return g_->add(std::move(l));
    }
    const auto t = s.find("type");
    if (t == s.end()) {  // inferred from the keywords present
      if (s.contains("properties") || s.contains("additionalProperties") || s.contains("required")) return typed(s, "object", at);
      if (s.contains("items") || s.contains("minItems") || s.contains("maxItems")) return typed(s, "array", at);
      if (s.contains("minLength") || s.contains("maxLength") || s.contains("pattern") || s.contains("format"))
        return typed(s, "string", at);
      return json_grammar::any;
    }
    if (t->is_string()) return typed(s, t->get<std::string>(), at);
    if (t->is_array() && !t->empty()) {
      json_node u;
      u.k = json_node::kind::any_of;
      for (const auto& one : *t) {
        if (!one.is_string()) throw schema_error("'type' (at " + at + ") must list type names");
        u.branches.push_back(typed(s, one.get<std::string>(), at));
      }
      return u.branches.size() == 1 ? u.branches[0] : g_->add(std::move(u));
    }
    throw schema_error("'type' (at " + at + ") must be a type name or a non-empty list of them");
  }

  int32_t typed(const json& s, const std::string& type, const std::string& at) {
    json_node n;
    if (type == "object") {
      const auto props = s.find("properties");
      const auto extra = s.find("additionalProperties");
      if (props == s.end() && extra == s.end() && !s.contains("required")) return json_grammar::any_object_node;
      n.k = json_node::kind::object;
      std::set<std::string> required;
      if (const auto r = s.find("required"); r != s.end()) {
        if (!r->is_array()) throw schema_error("'required' (at " + at + ") must be an array of names");
        for (const auto& name : *r) {
          if (!name.is_string()) throw schema_error("'required' (at " + at + ") must be an array of names");
          required.insert(name.get<std::string>());
        }
      }
      // The node's index first, so properties may refer back to it through $ref.
      const int32_t self = g_->add(json_node{});
      if (props != s.end()) {
        if (!props->is_object()) throw schema_error("'properties' (at " + at + ") must be an object");
        for (const auto& [name, sub] : props->items()) {
          json_node::property p;
          const std::string quoted = json(name).dump();
          p.key = quoted.substr(1, quoted.size() - 2);
          p.value = compile(sub, at + "/properties/" + name);
          p.required = required.erase(name) > 0;
          n.properties.push_back(std::move(p));
        }
      }
      if (!required.empty())
        throw schema_error("the required property '" + *required.begin() + "' (at " + at + ") is not in 'properties'");
      if (extra != s.end()) {
        if (extra->is_boolean())
          n.additional = extra->get<bool>() ? json_grammar::any : -1;
        else
          n.additional = compile(*extra, at + "/additionalProperties");
      }
      g_->at(self) = std::move(n);
      return self;
    }
    if (type == "array") {
      n.k = json_node::kind::array;
      const int32_t self = g_->add(json_node{});
      n.items = json_grammar::any;
      if (const auto i = s.find("items"); i != s.end()) {
        if (i->is_array()) throw schema_error("'items' (at " + at + ") as a list (tuple validation) is not supported");
        n.items = compile(*i, at + "/items");
      }
      if (s.contains("minItems")) n.min_items = non_negative(s, "minItems", at);
      if (s.contains("maxItems")) n.max_items = non_negative(s, "maxItems", at);
      g_->at(self) = std::move(n);
      return self;
    }
    if (type == "string") {
      n.k = json_node::kind::string;
      if (s.contains("minLength")) n.min_length = non_negative(s, "minLength", at);
      if (s.contains("maxLength")) n.max_length = non_negative(s, "maxLength", at);
      if (const auto f = s.find("format"); f != s.end()) {
        if (!f->is_string() || !format_patterns().count(f->get<std::string>()))
          throw schema_error("'format' (at " + at + ") is supported for date, time, date-time and uuid only");
        n.pattern = format_patterns().at(f->get<std::string>());
      }
      if (const auto p = s.find("pattern"); p != s.end()) {
        if (!p->is_string()) throw schema_error("'pattern' (at " + at + ") must be a string");
        if (!n.pattern.empty()) throw schema_error("'pattern' and 'format' together (at " + at + ") are not supported");
        n.pattern = p->get<std::string>();
      }
      if (!n.pattern.empty() && (s.contains("minLength") || s.contains("maxLength")))
        throw schema_error("'pattern' or 'format' with 'minLength'/'maxLength' (at " + at + ") is not supported: put the length in the pattern");
      return g_->add(std::move(n));
    }
    if (type == "number" || type == "integer") {
      n.k = json_node::kind::number;
      n.integer = type == "integer";
      return g_->add(std::move(n));
    }
    if (type == "boolean" || type == "null") {
      n.k = json_node::kind::literal;
      n.literals = type == "null" ? std::vector<std::string>{"null"} : std::vector<std::string>{"true", "false"};
      return g_->add(std::move(n));
    }
    throw schema_error("the type '" + type + "' (at " + at + ") is not a JSON Schema type");
  }

  int32_t reference(const json& r, const std::string& at) {
    if (!r.is_string()) throw schema_error("'$ref' (at " + at + ") must be a string");
    const std::string ref = r.get<std::string>();
    if (ref.empty() || ref[0] != '#') throw schema_error("'$ref' \"" + ref + "\" (at " + at + "): only references inside the schema (\"#...\") are supported");
    if (auto it = refs_.find(ref); it != refs_.end()) return it->second;
    const json* target = &root_;
    if (ref != "#") {
      try {
        target = &root_.at(json::json_pointer(ref.substr(1)));
      } catch (const std::exception&) {
        throw schema_error("'$ref' \"" + ref + "\" (at " + at + ") points at nothing in the schema");
      }
    }
    // A placeholder any-of of one branch, so a cycle through this reference resolves to it.
    json_node u;
    u.k = json_node::kind::any_of;
    const int32_t self = g_->add(std::move(u));
    refs_[ref] = self;
    const int32_t body = compile(*target, ref);
    g_->at(self).branches = {body};
    return self;
  }

  const json& root_;
  std::shared_ptr<json_grammar> g_;
  std::map<std::string, int32_t> refs_;
  int depth_ = 0;
};

}  // namespace

std::shared_ptr<const engine::json_grammar> compile_json_schema(const nlohmann::ordered_json& schema) {
  return compiler(schema).run();
}

}  // namespace troupe::net
