/* test_template.c - cmocka tests for models/template: every language feature against outputs
 * produced by Jinja2 3.1.6 configured as transformers configures it (sandboxed, trim_blocks,
 * lstrip_blocks, loopcontrols, tojson = json.dumps), error messages with lines, resource limits,
 * the tokenizer-directory loader, and the golden prompts rendered by transformers'
 * apply_chat_template (tests/data/templates/<name>.jsonl, needs $KILN_TOKENIZER_CACHE). */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/json.h"
#include "models/template/template.h"

/* ---- the feature table ---------------------------------------------------------------------- */

typedef struct tt_case {
  const char *name, *src, *vars, *expected;
  bool error; /* expected is then the whole error message (the template is named "t") */
} tt_case_t;

/* Expected outputs come from Jinja2 (see the file comment); error rows were checked to fail
 * there too, and hold Kiln's message. */
static const tt_case_t k_cases[] = {
    {"ws_trim", "{% if true %}\nyes\n{% endif %}\nafter", "{}", "yes\nafter", false},
    {"ws_lstrip", "  {% if true %}\n  x\n  {% endif %}\n  {{ 1 }}  {% if 1 %}y{% endif %}", "{}",
     "  x\n  1  y", false},
    {"ws_minus", "a  \n {{- 'b' -}} \n  c", "{}", "abc", false},
    {"ws_minus_block", "a \n {%- if 1 -%} \n b \n {%- endif -%} \n c", "{}", "abc", false},
    {"ws_plus", "  {%+ if 1 %}x{% endif +%}\ny", "{}", "  x\ny", false},
    {"ws_comment", "a\n  {# c #}\nb{#- x -#}  c  {# y #}\nd", "{}", "a\nbc  d", false},
    {"ws_var_no_lstrip", "x\n   {{ 'v' }}\n", "{}", "x\n   v", false},
    {"ws_trailing_nl", "abc\n", "{}", "abc", false},
    {"ws_crlf", "a\r\n{% if 1 %}\r\nb\r\n{% endif %}\r\n", "{}", "a\nb\n", false},
    {"ws_raw",
     "{% raw %}{{ not }} {% evaluated %}{% endraw %}|\n  {% raw %}\n x\n  {% endraw %}\nz", "{}",
     "{{ not }} {% evaluated %}|\n\n x\nz", false},
    {"ws_line_after_var", "{{ 1 }}\n{% if 1 %}\n  a\n{% endif %}", "{}", "1\n  a\n", false},
    {"ws_tabs", "\t{% for i in [1,2] %}\n\t{{ i }}\n\t{% endfor %}\n", "{}", "\t1\n\t2\n", false},
    {"ws_no_newline_before", "x {% if 1 %}y{% endif %} z", "{}", "x y z", false},
    {"ws_after_var_end_newline", "{{ 'a' -}}\n   {% if 1 %}b{% endif %}", "{}", "ab", false},
    {"repr_list", "{{ [1, 'a', none, 1.0, true, {'k': (1,)}, \"it's\", 2.5e-7, 1e16, 1e15] }}",
     "{}", "[1, 'a', None, 1.0, True, {'k': (1,)}, \"it's\", 2.5e-07, 1e+16, 1000000000000000.0]",
     false},
    {"repr_dict", "{{ {'a': 1, 'b': [1,2], 3: 'x'} }}", "{}", "{'a': 1, 'b': [1, 2], 3: 'x'}",
     false},
    {"repr_tuple", "{{ (1, 2) }}{{ (1,) }}{{ () }}", "{}", "(1, 2)(1,)()", false},
    {"repr_str_escapes",
     "{{ ['a\\nb', 'q\"', \"s'\", 'both\\'\"', '\\\\', '\\t', '\xc3\xa9', '\\x01', '\\u200b'] }}",
     "{}", "['a\\nb', 'q\"', \"s'\", 'both\\'\"', '\\\\', '\\t', '\xc3\xa9', '\\x01', '\\u200b']",
     false},
    {"none_true", "{{ none }}|{{ true }}|{{ False }}|{{ None }}", "{}", "None|True|False|None",
     false},
    {"floats",
     "{{ 1.0 }} {{ 0.1 + 0.2 }} {{ 1e300 * 10 }} {{ 3.0 / 2 }} {{ 1/3 }} {{ -0.0 }} {{ "
     "123456789.123 }} {{ 1e-5 }} {{ 0.0001 }}",
     "{}", "1.0 0.30000000000000004 1e+301 1.5 0.3333333333333333 -0.0 123456789.123 1e-05 0.0001",
     false},
    {"ints",
     "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 2 ** 10 }} {{ 2 ** -1 }} "
     "{{ 7 / 7 }} {{ 1_000 }}",
     "{}", "3 -4 1 2 -2 1024 0.5 1.0 1000", false},
    {"str_escapes", "{{ 'a\\tb\\\\c\\x41\\u00e9\\101' }}", "{}",
     "a\tb\\cA\xc3\xa9"
     "A",
     false},
    {"adjacent_str", "{{ 'a' \"b\" 'c' }}", "{}", "abc", false},
    {"concat", "{{ 1 ~ 'a' ~ none ~ true ~ [1] ~ u }}", "{}", "1aNoneTrue[1]", false},
    {"str_mul", "{{ 'ab' * 3 }}{{ 2 * 'x' }}{{ [1] * 2 }}", "{}", "abababxx[1, 1]", false},
    {"list_add", "{{ [1] + [2, 3] }}{{ 'a' + 'b' }}", "{}", "[1, 2, 3]ab", false},
    {"pow_assoc", "{{ 2 ** 3 ** 2 }}", "{}", "64", false},
    {"unary", "{{ -3 }} {{ - -3 }} {{ -(2) ** 2 }} {{ +4 }} {{ -x|abs }}", "{\"x\": 5}",
     "-3 3 4 4 5", false},
    {"precedence",
     "{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 'a' ~ 1 ~ 2 }} {{ 1 + 2 ~ 3 }} {{ not 1 == 2 }} {{ 3 - "
     "1 - 1 }}",
     "{}", "t:1: unsupported operand type(s) for +: 'int' and 'str'", true},
    {"compare_chain",
     "{{ 1 < 2 < 3 }} {{ 1 < 3 < 2 }} {{ 1 == 1.0 }} {{ true == 1 }} {{ 'a' < 'b' }} {{ [1,2] < "
     "[1,3] }}",
     "{}", "True False True True True True", false},
    {"in_ops",
     "{{ 'a' in 'cat' }} {{ 2 in [1,2] }} {{ 'k' in {'k':1} }} {{ 3 not in [1] }} {{ 'x' not in "
     "'abc' }}",
     "{}", "True True True True True", false},
    {"and_or_values",
     "{{ 0 or 'x' }}|{{ 1 and 'y' }}|{{ '' and 1 }}|{{ none or none }}|{{ [] or [1] }}", "{}",
     "x|y||None|[1]", false},
    {"cond_expr", "{{ 'a' if true else 'b' }}{{ 'a' if false else 'b' }}[{{ 'a' if false }}]", "{}",
     "ab[]", false},
    {"cond_nested", "{{ 1 if x > 1 else 2 if x > 0 else 3 }}", "{\"x\": 1}", "2", false},
    {"attr_dict", "{{ m.role }} {{ m['content'] }} {{ m.missing }}|{{ m.missing is defined }}",
     "{\"m\": {\"role\": \"u\", \"content\": \"c\"}}", "u c |False", false},
    {"items_neg", "{{ xs[-1] }} {{ xs[0] }} {{ xs[5] }}| {{ 'h\xc3\xa9llo'[1] }} {{ 'abc'[-1] }}",
     "{\"xs\": [1, 2, 3]}", "3 1 | \xc3\xa9 c", false},
    {"slices",
     "{{ xs[1:] }} {{ xs[:-1] }} {{ xs[::-1] }} {{ xs[::2] }} {{ xs[1:2] }} {{ xs[5:] }} {{ "
     "xs[-2:] }} {{ xs[3:0:-1] }}",
     "{\"xs\": [0, 1, 2, 3, 4]}",
     "[1, 2, 3, 4] [0, 1, 2, 3] [4, 3, 2, 1, 0] [0, 2, 4] [1] [] [3, 4] [3, 2, 1]", false},
    {"str_slices", "{{ s[1:] }}|{{ s[::-1] }}|{{ s[:2] }}|{{ s[-3:] }}|{{ s[::2] }}",
     "{\"s\": \"h\xc3\xa9llo w\xc3\xb6rld\xf0\x9f\x98\x80\"}",
     "\xc3\xa9llo w\xc3\xb6rld\xf0\x9f\x98\x80|\xf0\x9f\x98\x80"
     "dlr\xc3\xb6w oll\xc3\xa9h|h\xc3\xa9|ld\xf0\x9f\x98\x80|hlowrd",
     false},
    {"dot_int", "{{ xs.0 }} {{ xs.1 }}", "{\"xs\": [5, 6]}", "5 6", false},
    {"messages_loop", "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}",
     "{\"messages\": [{\"role\": \"system\", \"content\": \"Sys\"}, {\"role\": \"user\", "
     "\"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"Yo\"}]}",
     "system:Sys;user:Hi;assistant:Yo;", false},
    {"messages_slice", "{% for m in messages[1:] %}{{ loop.index }}{{ m.role }}{% endfor %}",
     "{\"messages\": [{\"role\": \"system\", \"content\": \"Sys\"}, {\"role\": \"user\", "
     "\"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"Yo\"}]}",
     "1user2assistant", false},
    {"loop_vars",
     "{% for x in 'abc' %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 "
     "}}{{ loop.first }}{{ loop.last }}{{ loop.length }}|{% endfor %}",
     "{}", "1032TrueFalse3|2121FalseFalse3|3210FalseTrue3|", false},
    {"loop_prevnext", "{% for x in [1,2,3] %}{{ loop.previtem }}-{{ loop.nextitem }},{% endfor %}",
     "{}", "-2,1-3,2-,", false},
    {"loop_cycle", "{% for x in range(5) %}{{ loop.cycle('a','b','c') }}{% endfor %}", "{}",
     "abcab", false},
    {"loop_else",
     "{% for x in [] %}x{% else %}empty{% endfor %}{% for x in [1] %}{{x}}{% else %}no{% endfor %}",
     "{}", "empty1", false},
    {"loop_filter", "{% for x in range(10) if x is odd %}{{ x }}{{ loop.length }},{% endfor %}",
     "{}", "15,35,55,75,95,", false},
    {"loop_unpack",
     "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for a, b in [(1,2),(3,4)] "
     "%}{{a+b}}{% endfor %}",
     "{\"d\": {\"x\": 1, \"y\": [2]}}", "x=1;y=[2];37", false},
    {"loop_dict_iter", "{% for k in d %}{{ k }}{% endfor %}", "{\"d\": {\"b\": 1, \"a\": 2}}", "ba",
     false},
    {"loop_scope",
     "{% set x = 0 %}{% for i in range(3) %}{{ x }}{% set x = x + 1 %}{{ x }}{% endfor %}{{ x }}",
     "{}", "0101010", false},
    {"loop_nested",
     "{% for i in range(2) %}{% for j in range(2) %}{{ i }}{{ j }}{{ loop.index }} {% endfor %}{{ "
     "loop.index }}|{% endfor %}",
     "{}", "001 012 1|101 112 2|", false},
    {"break_continue",
     "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 5 %}{% break %}{% "
     "endif %}{{ i }}{% endfor %}",
     "{}", "0134", false},
    {"loop_recursive",
     "{% for n in tree recursive %}{{ n.name }}{% if n.children %}[{{ loop(n.children) }}]{% endif "
     "%}{% endfor %}",
     "{\"tree\": [{\"name\": \"a\", \"children\": [{\"name\": \"b\", \"children\": []}, {\"name\": "
     "\"c\"}]}, {\"name\": \"d\"}]}",
     "a[bc]d", false},
    {"range_args", "{{ range(3)|list }}{{ range(1,4)|list }}{{ range(10,0,-3)|list }}", "{}",
     "[0, 1, 2][1, 2, 3][10, 7, 4, 1]", false},
    {"set_basic", "{% set a = 1 %}{% set b, c = 2, 3 %}{{ a }}{{ b }}{{ c }}", "{}", "123", false},
    {"set_block",
     "{% set x %}hello {{ 1 }}{% endset %}[{{ x }}]{% set y | upper %}abc{% endset %}{{ y }}", "{}",
     "[hello 1]ABC", false},
    {"namespace",
     "{% set ns = namespace(a=1, found=false) %}{% for i in range(3) %}{% set ns.a = ns.a + i %}{% "
     "if i == 1 %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.a }} {{ ns.found }}",
     "{}", "4 True", false},
    {"set_in_if", "{% if true %}{% set z = 5 %}{% endif %}{{ z }}", "{}", "5", false},
    {"macro_basic",
     "{% macro m(a, b=2) %}[{{a}}{{b}}{{c}}]{% endmacro %}{% set c = 5 %}{{ m(1) }}{{ m(1, b=3) "
     "}}{{ m(b=4, a=0) }}",
     "{}", "[125][135][045]", false},
    {"macro_recursive",
     "{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(4) }}", "{}",
     "4321", false},
    {"macro_missing_arg",
     "{% macro m(a, b) %}{{ a }}|{{ b }}|{{ b is defined }}{% endmacro %}{{ m(1) }}", "{}",
     "1||False", false},
    {"macro_ws",
     "{% macro render(x) %}\n  <{{ x }}>\n{% endmacro %}\n{{ render(1) }}{{ render(2) }}", "{}",
     "  <1>\n  <2>\n", false},
    {"with_block", "{% with a = 1, b = 2 %}{{ a + b }}{% endwith %}[{{ a }}]", "{}", "3[]", false},
    {"filter_block", "{% filter upper %}hello {{ 'x' }}{% endfilter %}", "{}", "HELLO X", false},
    {"generation",
     "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% "
     "endgeneration %}{% endif %}{% endfor %}",
     "{\"messages\": [{\"role\": \"system\", \"content\": \"Sys\"}, {\"role\": \"user\", "
     "\"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"Yo\"}]}",
     "Yo", false},
    {"f_trim", "[{{ '  a b \\n'|trim }}][{{ 'xxaxx'|trim('x') }}]", "{}", "[a b][a]", false},
    {"f_case",
     "{{ 'hello World'|upper }} {{ 'HeLLo'|lower }} {{ 'hello WORLD'|capitalize }} {{ 'hello "
     "wORLD-foo (bar'|title }}",
     "{}", "HELLO WORLD hello Hello world Hello World-Foo (Bar", false},
    {"f_length",
     "{{ [1,2]|length }} {{ 'h\xc3\xa9llo'|length }} {{ {'a':1}|length }} {{ u|length }} {{ "
     "[1,2,3]|count }}",
     "{}", "2 5 1 0 3", false},
    {"f_default",
     "{{ u|default('d') }} {{ ''|default('d') }} {{ ''|default('d', true) }} {{ none|default('d') "
     "}} {{ none|d('x', boolean=true) }} {{ 0|default(5) }}",
     "{}", "d  d None x 0", false},
    {"f_join",
     "{{ [1,'a',none]|join(', ') }}|{{ ['a','b']|join }}|{{ xs|join(',', attribute='n') }}",
     "{\"xs\": [{\"n\": 1}, {\"n\": 2}]}", "1, a, None|ab|1,2", false},
    {"f_first_last", "{{ [1,2,3]|first }} {{ [1,2,3]|last }} {{ 'abc'|first }} {{ []|first }}",
     "{}", "1 3 a ", false},
    {"f_list_reverse",
     "{{ 'abc'|list }} {{ [1,2,3]|reverse|list }} {{ 'abc'|reverse }} {{ {'a':1}|list }}", "{}",
     "['a', 'b', 'c'] [3, 2, 1] cba ['a']", false},
    {"f_sort",
     "{{ [3,1,2]|sort }} {{ ['b','A','c']|sort }} {{ ['b','A','c']|sort(case_sensitive=true) }} {{ "
     "[3,1,2]|sort(reverse=true) }} {{ xs|sort(attribute='n')|map(attribute='n')|list }}",
     "{\"xs\": [{\"n\": 2}, {\"n\": 1}]}",
     "[1, 2, 3] ['A', 'b', 'c'] ['A', 'b', 'c'] [3, 2, 1] [1, 2]", false},
    {"f_unique", "{{ [1,2,1,3]|unique|list }} {{ ['a','A','b']|unique|list }}", "{}",
     "[1, 2, 3] ['a', 'b']", false},
    {"f_map",
     "{{ xs|map(attribute='n')|list }} {{ ['a','b']|map('upper')|list }} {{ xs|map(attribute='z', "
     "default=0)|list }}",
     "{\"xs\": [{\"n\": 1}, {\"n\": 2}]}", "[1, 2] ['A', 'B'] [0, 0]", false},
    {"f_select",
     "{{ range(6)|select('odd')|list }} {{ range(6)|reject('even')|list }} {{ "
     "[0,1,'',2]|select|list }} {{ [1,2,3]|select('equalto', 2)|list }} {{ [1,5,3]|select('gt', "
     "2)|list }}",
     "{}", "[1, 3, 5] [1, 3, 5] [1, 2] [2] [5, 3]", false},
    {"f_selectattr",
     "{{ M|selectattr('role', 'equalto', 'user')|map(attribute='content')|list }} {{ "
     "M|rejectattr('role', 'eq', 'user')|list|length }} {{ xs|selectattr('x')|list }} {{ "
     "xs|selectattr('x', 'defined')|list|length }}",
     "{\"M\": [{\"role\": \"system\", \"content\": \"Sys\"}, {\"role\": \"user\", \"content\": "
     "\"Hi\"}, {\"role\": \"assistant\", \"content\": \"Yo\"}], \"xs\": [{\"x\": 0}, {\"x\": 1}, "
     "{\"y\": 2}]}",
     "['Hi'] 2 [{'x': 1}] 2", false},
    {"f_items_dictsort",
     "{{ d|items|list }} {{ d|dictsort }} {{ d|dictsort(by='value') }} {{ d|dictsort(reverse=true) "
     "}}",
     "{\"d\": {\"b\": 2, \"a\": 3, \"C\": 1}}",
     "[('b', 2), ('a', 3), ('C', 1)] [('a', 3), ('b', 2), ('C', 1)] [('C', 1), ('b', 2), ('a', 3)] "
     "[('C', 1), ('b', 2), ('a', 3)]",
     false},
    {"f_string_int_float",
     "{{ 1|string ~ 'x' }} {{ '42'|int + 1 }} {{ '4.7'|int }} {{ 'x'|int }} {{ 'x'|int(7) }} {{ "
     "3.9|int }} {{ '2.5'|float }} {{ 'a'|float }} {{ 3|float }} {{ true|int }}",
     "{}", "1x 43 4 0 7 3 2.5 0.0 3.0 1", false},
    {"f_abs_round",
     "{{ -3|abs }} {{ (-2.5)|abs }} {{ 2.5|round }} {{ 3.5|round }} {{ 2.675|round(2) }} {{ "
     "2.1|round(0, 'ceil') }} {{ 2.9|round(method='floor') }} {{ 5|round }}",
     "{}", "3 2.5 2.0 4.0 2.67 3.0 2.0 5", false},
    {"f_replace",
     "{{ 'aaa'|replace('a', 'b') }} {{ 'aaa'|replace('a', 'b', 2) }} {{ 'abc'|replace('', '-') }}",
     "{}", "bbb bba -a-b-c-", false},
    {"f_indent",
     "{{ 'a\\nb\\n\\nc'|indent }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'a\\n\\nb\\n'|indent(2, "
     "blank=true) }}|{{ 'x\\ny'|indent('> ') }}",
     "{}", "a\n    b\n\n    c|  a\n  b|a\n  \n  b\n  |x\n> y", false},
    {"f_center_wordcount",
     "[{{ 'ab'|center(7) }}][{{ 'abc'|center(6) }}] {{ 'hello big  world'|wordcount }}", "{}",
     "[   ab  ][ abc  ] 3", false},
    {"f_escape_safe", "{{ '<a href=\"x\">&\\'</a>'|e }} {{ '<b>'|safe }} {{ '<'|escape }}", "{}",
     "&lt;a href=&#34;x&#34;&gt;&amp;&#39;&lt;/a&gt; <b> &lt;", false},
    {"f_minmax_sum",
     "{{ [3,1,2]|min }} {{ [3,1,2]|max }} {{ ['b','A']|min }} {{ [1,2,3]|sum }} {{ [1.5,2]|sum }} "
     "{{ xs|sum(attribute='n') }} {{ xs|max(attribute='n') }}",
     "{\"xs\": [{\"n\": 1}, {\"n\": 5}]}", "1 3 A 6 3.5 6 {'n': 5}", false},
    {"f_attr", "{{ d|attr('a') }}", "{\"d\": {\"a\": 7}}", "", false},
    {"f_chain", "{{ messages|map(attribute='role')|join(',')|upper }}",
     "{\"messages\": [{\"role\": \"system\", \"content\": \"Sys\"}, {\"role\": \"user\", "
     "\"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"Yo\"}]}",
     "SYSTEM,USER,ASSISTANT", false},
    /* json.loads keeps 1.0 a float and 1 an int; tojson writes each back as it came. */
    {"json_float_vs_int",
     "{{ x|tojson }} {{ x.f }} {{ x.i }} {{ x.f is float }} {{ x.i is integer }}",
     "{\"x\": {\"f\": 1.0, \"i\": 1, \"e\": 2e3}}",
     "{\"f\": 1.0, \"i\": 1, \"e\": 2000.0} 1.0 1 True True", false},
    {"tojson_basic", "{{ x|tojson }}",
     "{\"x\": {\"a\": [1, 2.5, null, true, \"\xc3\xa9\\\"\\n<>&\"], \"b\": {}, \"c\": []}}",
     "{\"a\": [1, 2.5, null, true, \"\xc3\xa9\\\"\\n<>&\"], \"b\": {}, \"c\": []}", false},
    {"tojson_indent", "{{ x|tojson(indent=2) }}",
     "{\"x\": {\"a\": [1, {\"b\": 2}], \"c\": [], \"d\": {}}}",
     "{\n  \"a\": [\n    1,\n    {\n      \"b\": 2\n    }\n  ],\n  \"c\": [],\n  \"d\": {}\n}",
     false},
    {"tojson_sort", "{{ x|tojson(sort_keys=true) }}|{{ x|tojson(indent=4, sort_keys=true) }}",
     "{\"x\": {\"b\": 1, \"a\": {\"d\": 1, \"c\": 2}}}",
     "{\"a\": {\"c\": 2, \"d\": 1}, \"b\": 1}|{\n    \"a\": {\n        \"c\": 2,\n        \"d\": "
     "1\n    },\n    \"b\": 1\n}",
     false},
    {"tojson_sep", "{{ x|tojson(separators=(',', ':')) }}", "{\"x\": {\"a\": [1, 2]}}",
     "{\"a\":[1,2]}", false},
    {"tojson_ascii", "{{ x|tojson(ensure_ascii=true) }}", "{\"x\": [\"\xc3\xa9\xf0\x9f\x98\x80\"]}",
     "[\"\\u00e9\\ud83d\\ude00\"]", false},
    {"tojson_scalars",
     "{{ 1|tojson }} {{ 1.0|tojson }} {{ 'a'|tojson }} {{ none|tojson }} {{ true|tojson }} {{ "
     "(1,2)|tojson }} {{ {1: 2, true: 3, none: 4}|tojson }}",
     "{}", "1 1.0 \"a\" null true [1, 2] {\"1\": 3, \"null\": 4}", false},
    {"tojson_tools", "{% for t in tools %}{{ t|tojson }}\n{% endfor %}",
     "{\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
     "\"description\": \"Get it\", \"parameters\": {\"type\": \"object\", \"properties\": "
     "{\"city\": {\"type\": \"string\", \"enum\": [\"a\", \"b\"]}}, \"required\": [\"city\"]}}}]}",
     "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Get "
     "it\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": "
     "\"string\", \"enum\": [\"a\", \"b\"]}}, \"required\": [\"city\"]}}}\n",
     false},
    {"tests_types",
     "{{ 1 is number }}{{ 1.0 is float }}{{ 1 is integer }}{{ true is integer }}{{ true is boolean "
     "}}{{ 'a' is string }}{{ {} is mapping }}{{ [] is iterable }}{{ 'a' is sequence }}{{ {} is "
     "sequence }}{{ u is iterable }}{{ none is none }}{{ u is undefined }}{{ range is callable }}",
     "{}", "TrueTrueTrueFalseTrueTrueTrueTrueTrueTrueTrueTrueTrueTrue", false},
    {"tests_values",
     "{{ 3 is odd }}{{ 4 is even }}{{ 9 is divisibleby 3 }}{{ 9 is divisibleby(4) }}{{ 2 is eq 2 "
     "}}{{ 2 is ne 2 }}{{ 1 is lt 2 }}{{ 3 is ge 3 }}{{ 'a' is in 'abc' }}{{ 'abc' is lower }}{{ "
     "'ABC' is upper }}{{ 'aB' is lower }}{{ true is true }}{{ 1 is true }}{{ false is false }}{{ "
     "none is sameas none }}",
     "{}", "TrueTrueTrueFalseTrueFalseTrueTrueTrueTrueTrueFalseTrueFalseTrueTrue", false},
    {"tests_not", "{{ x is not none }}{{ x is not defined }}{{ not x is defined }}", "{\"x\": 1}",
     "TrueFalseFalse", false},
    {"test_filter_test", "{{ 'upper' is filter }}{{ 'nope' is filter }}{{ 'odd' is test }}", "{}",
     "TrueFalseTrue", false},
    {"m_str",
     "{{ 'abc'.startswith('a') }}{{ 'abc'.endswith(('x','c')) }}{{ '  x '.strip() }}|{{ "
     "'xxaxx'.lstrip('x') }}|{{ 'xxaxx'.rstrip('x') }}|{{ 'a,b,,c'.split(',') }}{{ ' a  b "
     "'.split() }}{{ 'a b c'.split(' ', 1) }}{{ 'a b c'.rsplit(' ', 1) }}{{ '  a  b  c  "
     "'.split(None, 1) }}{{ '  a  b  c  '.rsplit(None, 1) }}",
     "{}",
     "TrueTruex|axx|xxa|['a', 'b', '', 'c']['a', 'b']['a', 'b c']['a b', 'c']['a', 'b  c  ']['  a  "
     "b', 'c']",
     false},
    {"m_str2",
     "{{ 'Hello'.upper() }}{{ 'Hello'.lower() }}{{ \"they're bill's\".title() }}{{ 'hELLO "
     "wORLD'.capitalize() }}{{ 'aXa'.replace('a', 'b') }}{{ 'abcabc'.find('c') }}{{ "
     "'abcabc'.rfind('c') }}{{ 'abc'.find('z') }}{{ 'aaa'.count('a') }}{{ '-'.join(['a','b']) }}{{ "
     "'h\xc3\xa9llo'.find('l') }}",
     "{}", "HELLOhelloThey'Re Bill'SHello worldbXb25-13a-b2", false},
    {"m_str3",
     "{{ '12'.isdigit() }}{{ 'ab'.isalpha() }}{{ ' '.isspace() }}{{ 'a\\nb\\r\\nc'.splitlines() "
     "}}{{ '42'.zfill(5) }}",
     "{}", "TrueTrueTrue['a', 'b', 'c']00042", false},
    {"m_dict",
     "{{ d.items()|list }} {{ d.keys()|list }} {{ d.values()|list }} {{ d.get('a') }} {{ "
     "d.get('z') }} {{ d.get('z', 9) }}",
     "{\"d\": {\"a\": 1, \"b\": 2}}", "[('a', 1), ('b', 2)] ['a', 'b'] [1, 2] 1 None 9", false},
    {"m_list", "{{ [1,2,3].index(2) }} {{ [1,2,2].count(2) }}", "{}", "1 2", false},
    {"content_split",
     "{% set c = m.content %}{% if '</think>' in c %}{{ c.split('</think>')[-1].lstrip('\\n') "
     "}}|{{ c.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') }}{% endif %}",
     "{\"m\": {\"content\": \"<think>\\nreason\\n</think>\\n\\nanswer\"}}", "answer|reason", false},
    {"content_list",
     "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in "
     "m.content %}{% if p.type == 'text' %}{{ p.text }}{% else %}<{{ p.type }}>{% endif %}{% "
     "endfor %}{% endif %}{% endfor %}",
     "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image\"}, {\"type\": "
     "\"text\", \"text\": \"What?\"}]}, {\"role\": \"assistant\", \"content\": \"A\"}]}",
     "<image>What?A", false},
    {"globals", "{{ dict(a=1) }} {{ namespace(x=1).x }}", "{}", "{'a': 1} 1", false},
    {"bos_eos", "{{ bos_token }}|{{ eos_token }}|{{ bos_token is defined }}",
     "{\"bos_token\": \"<s>\"}", "<s>||True", false},
    {"unicode_out",
     "{{ 'h\xc3\xa9llo \xf0\x9f\x98\x80 \xe4\xb8\x96\xe7\x95\x8c'|upper }} {{ "
     "'\xc3\x84\xc3\x96\xc3\x9c'|lower }} {{ '\xc3\x9f'|length }}",
     "{}", "H\xc3\x89LLO \xf0\x9f\x98\x80 \xe4\xb8\x96\xe7\x95\x8c \xc3\xa4\xc3\xb6\xc3\xbc 1",
     false},
    {"none_attr", "{{ m.content is none }} {{ m.tool_calls is defined }}",
     "{\"m\": {\"content\": null}}", "True False", false},
    {"json_float_vals", "{{ x }} {{ y }} {{ x + y }} {{ z }}",
     "{\"x\": 1.5, \"y\": 2, \"z\": 1e+20}", "1.5 2 3.5 1e+20", false},
    {"json_nested", "{{ d }} {{ d.a }}",
     "{\"d\": {\"a\": [1, {\"b\": \"c\"}], \"e\": null, \"f\": true}}",
     "{'a': [1, {'b': 'c'}], 'e': None, 'f': True} [1, {'b': 'c'}]", false},
    {"mixed_types_eq",
     "{{ [1,2] == [1,2] }} {{ {'a':1} == {'a':1} }} {{ d == {'a': 1} }} {{ (1,2) == [1,2] }} {{ "
     "none == none }} {{ u == u }}",
     "{\"d\": {\"a\": 1}}", "True True True False True True", false},
    {"string_iter_count", "{% for ch in 'h\xf0\x9f\x98\x80\xc3\xa9' %}[{{ ch }}]{% endfor %}", "{}",
     "[h][\xf0\x9f\x98\x80][\xc3\xa9]", false},
    {"whitespace_qwen_like",
     "{%- if tools %}\n    {{- 'T' }}\n{%- else %}\n    {{- 'N' }}\n{%- endif %}\n{%- for m in "
     "messages %}\n    {{- m.role + '\\n' }}\n{%- endfor %}\n",
     "{\"messages\": [{\"role\": \"system\", \"content\": \"Sys\"}, {\"role\": \"user\", "
     "\"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"Yo\"}], \"tools\": null}",
     "Nsystem\nuser\nassistant\n", false},
    {"e_undefined_attr", "{{ u.x }}", "{}", "t:1: 'u' is undefined", true},
    {"e_add", "{{ 'a' + 1 }}", "{}", "t:1: can only concatenate str (not \"int\") to str", true},
    {"e_raise", "line1\n{{ raise_exception('bad role') }}", "{}", "t:2: bad role", true},
    {"e_unknown_filter", "{{ 1 }}\n{% if false %}{{ x|frobnicate }}{% endif %}", "{}", "1\n",
     false},
    {"e_syntax", "{% if %}", "{}", "t:1: expected an expression, got end of statement block", true},
    {"e_unclosed", "{% for x in y %}\nabc", "{}",
     "t:2: unexpected end of template: the 'for' block needs '{% endfor %}'", true},
    {"e_endfor_mismatch", "{% if 1 %}{% endfor %}", "{}",
     "t:1: unexpected 'endfor' inside the 'if' block (expected 'endif')", true},
    {"e_append", "{% set xs = [1] %}{% set _ = xs.append(2) %}{{ xs }}", "{}",
     "t:1: access to attribute 'append' of 'list' object is unsafe.", true},
    {"e_div0", "{{ 1 / 0 }}", "{}", "t:1: division by zero", true},
    {"e_call_undefined", "{{ foo() }}", "{}", "t:1: 'foo' is undefined", true},
    {"e_iter_int", "{% for x in 5 %}{% endfor %}", "{}", "t:1: 'int' object is not iterable", true},
    {"e_unknown_tag", "{% frob %}", "{}", "t:1: unknown tag 'frob'", true},
    {"e_unterminated_str", "{{ 'abc }}", "{}", "t:1: unterminated string literal", true},
    {"e_cmp", "{{ 1 < 'a' }}", "{}", "t:1: '<' not supported between instances of 'int' and 'str'",
     true},
    {"e_bad_unpack", "{% for a, b in [1] %}{% endfor %}", "{}", "t:1: 'int' object is not iterable",
     true},
    {"e_unknown_test", "{{ 1 is frobbed }}", "{}", "t:1: unknown test 'frobbed'", true},
    {"e_missing_comment", "{# abc", "{}", "t:1: Missing end of comment tag", true},
    {"e_undef_arith", "{{ u + 1 }}", "{}", "t:1: 'u' is undefined", true},
    {"e_range_big", "{{ range(1000000)|length }}", "{}",
     "t:1: Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).", true},
    {"e_len_int", "{{ 5|length }}", "{}", "t:1: object of type 'int' has no len()", true},
    {"fmt_pos", "{{ '{} and {}'.format('a', 1) }}|{{ '{1}{0}{1}'.format('x', 'y') }}", "{}",
     "a and 1|yxy", false},
    {"fmt_kw", "{{ 'Hi {name}, {n} msgs'.format(name=user, n=3) }}", "{\"user\": \"Ann\"}",
     "Hi Ann, 3 msgs", false},
    {"fmt_align", "[{:>8}][{:<6}][{:^7}][{:*^9}][{:08.3f}]", "{}",
     "[{:>8}][{:<6}][{:^7}][{:*^9}][{:08.3f}]", false},
    {"fmt_align_r",
     "{{ '[{:>8}][{:<6}][{:^7}][{:*^9}][{:08.3f}]'.format('ab', 'cd', 'ef', 'g', 3.14159) }}", "{}",
     "[      ab][cd    ][  ef   ][****g****][0003.142]", false},
    {"fmt_float",
     "{{ '{0:.2f} {0:e} {0:.3g} {0:%} {0} {0:.2} {1:.3} {2:g}'.format(1234.5678, 12.0, 1e-7) }}",
     "{}", "1234.57 1.234568e+03 1.23e+03 123456.780000% 1234.5678 1.2e+03 12.0 1e-07", false},
    {"fmt_int",
     "{{ '{0:d} {0:x} {0:X} {0:o} {0:b} {0:#x} {0:#o} {0:#b} {0:+d} {0: d} {1:+} "
     "{2:c}'.format(255, -3, 65) }}",
     "{}", "255 ff FF 377 11111111 0xff 0o377 0b11111111 +255  255 -3 A", false},
    {"fmt_group",
     "{{ '{:,} {:_} {:,.2f} {:_x} {:>12,}'.format(1234567, 1234567, 1234567.891, 12345678, -98765) "
     "}}",
     "{}", "1,234,567 1_234_567 1,234,567.89 bc_614e      -98,765", false},
    {"fmt_conv", "{{ '{!r} {!s} {0!r:>8}'.format('a', 1) }}", "{}",
     "t:1: cannot switch from manual field specification to automatic field numbering", true},
    {"fmt_conv2", "{{ '{0!r} {0!s} {0!r:>8}'.format('a') }}", "{}", "'a' a      'a'", false},
    {"fmt_attr", "{{ '{0[role]}: {0[content]} / {m.role} / {l[1]}'.format(msg, m=msg, l=[5, 6]) }}",
     "{\"msg\": {\"role\": \"user\", \"content\": \"hi\"}}", "user: hi / user / 6", false},
    {"fmt_attr_dot", "{{ '{0.role}'.format(msg) }}", "{\"msg\": {\"role\": \"user\"}}", "user",
     false},
    {"fmt_braces", "{{ '{{literal}} {}'.format(1) }}", "{}", "{literal} 1", false},
    {"fmt_nested", "{{ '[{:>{w}}]'.format('x', w=5) }}", "{}", "[    x]", false},
    {"fmt_values", "{{ '{} {} {} {} {}'.format(none, true, [1, 'a'], {'k': 1}, 2.5) }}", "{}",
     "None True [1, 'a'] {'k': 1} 2.5", false},
    {"fmt_bool_spec", "{{ '{:>5}|{:d}|{:.1f}'.format(true, false, true) }}", "{}", "    1|0|1.0",
     false},
    {"fmt_zero", "{{ '{:05}|{:05}|{:=+8}|{:#010x}|{:05}'.format(42, -42, -5, 255, 'ab') }}", "{}",
     "00042|-0042|-      5|0x000000ff|ab000", false},
    {"fmt_unicode",
     "{{ '[{:\xc3\xa9"
     "^7}][{:>4}]'.format('ab', '\xc3\xa9"
     "\xc3\xa9"
     "') }}",
     "{}",
     "[\xc3\xa9"
     "\xc3\xa9"
     "ab\xc3\xa9"
     "\xc3\xa9"
     "\xc3\xa9"
     "][  \xc3\xa9"
     "\xc3\xa9"
     "]",
     false},
    {"fmt_trunc", "{{ '{:.3}|{:5.2}|'.format('abcdef', 'xyz') }}", "{}", "abc|xy   |", false},
    {"fmt_inf", "{% set x = 1e308 * 10 %}{{ '{:f} {:F} {:e} {:08} {:%}'.format(x, x, -x, x, x) }}",
     "{}", "t:1: fixed-point formatting of numbers this large is not supported", true},
    {"fmt_map", "{{ '{a}-{b}'.format_map({'a': 1, 'b': 2}) }}", "{}", "1-2", false},
    {"fmt_err_index", "{{ '{} {}'.format(1) }}", "{}", "t:1: tuple index out of range", true},
    {"fmt_err_key", "{{ '{x}'.format(y=1) }}", "{}", "t:1: 'x'", true},
    {"fmt_err_switch", "{{ '{}{0}'.format(1) }}", "{}",
     "t:1: cannot switch from manual field specification to automatic field numbering", true},
    {"fmt_err_brace", "{{ 'a}'.format(1) }}", "{}", "t:1: Single '}' encountered in format string",
     true},
    {"fmt_err_code", "{{ '{:d}'.format('a') }}", "{}",
     "t:1: Unknown format code 'd' for object of type 'str'", true},
    {"fmt_err_sign_str", "{{ '{:+}'.format('a') }}", "{}",
     "t:1: Sign not allowed in string format specifier", true},
    {"fmt_err_prec_int", "{{ '{:.2}'.format(5) }}", "{}",
     "t:1: Precision not allowed in integer format specifier", true},
    {"fmt_err_none", "{{ '{:>5}'.format(none) }}", "{}",
     "t:1: unsupported format string passed to NoneType.__format__", true},
    {"fmt_err_float_d", "{{ '{:d}'.format(1.5) }}", "{}",
     "t:1: Unknown format code 'd' for object of type 'float'", true},
    {"fmt_unsafe_attr", "{{ '{0.update}'.format({}) }}", "{}", "", false},
    {"fmt_undefined", "[{{ '{}'.format(nope) }}]", "{}", "[]", false},
    {"pct_basic",
     "{{ '%s: %d' % ('a', 3) }}|{{ '%.2f' % 3.14159 }}|{{ '%s' % 'x' }}|{{ '%5d|%-5d|%05d' % (42, "
     "42, -42) }}",
     "{}", "a: 3|3.14|x|   42|42   |-0042", false},
    {"pct_map", "{{ '%(role)s says %(content)r' % msg }}",
     "{\"msg\": {\"role\": \"user\", \"content\": \"hi\"}}", "user says 'hi'", false},
    {"pct_types",
     "{{ '%x %X %o %#x %#o %e %E %g %G %c %c %i %u %%' % (255, 255, 8, 255, 8, 12345.678, 0.00012, "
     "1e-5, 1e20, 65, 'z', 3.9, 7) }}",
     "{}", "ff FF 10 0xff 0o10 1.234568e+04 1.200000E-04 1e-05 1E+20 A z 3 7 %", false},
    {"pct_list", "{{ '%s' % [1, 2] }}|{{ '%s' % {'a': 1} }}|{{ '%r' % 'q' }}|{{ 'none' % {} }}",
     "{}", "[1, 2]|{'a': 1}|'q'|none", false},
    {"pct_star", "{{ '[%*d][%-*s][%.*f]' % (5, 1, 4, 'ab', 2, 3.14159) }}", "{}",
     "[    1][ab  ][3.14]", false},
    {"pct_flags",
     "{{ '%+d % d %+.1f %.3d %5.1s| %#06x %-6.2f|' % (5, 5, 2.25, 7, 'abc', 255, 1.5) }}", "{}",
     "+5  5 +2.2 007     a| 0x00ff 1.50  |", false},
    {"pct_bool", "{{ '%s %d %.1f %r' % (true, true, false, none) }}", "{}", "True 1 0.0 None",
     false},
    {"pct_float_int", "{{ '%d %i' % (3.99, -3.99) }}", "{}", "3 -3", false},
    {"pct_err_few", "{{ '%s %s' % ('a',) }}", "{}", "t:1: not enough arguments for format string",
     true},
    {"pct_err_many", "{{ '%s' % (1, 2) }}", "{}",
     "t:1: not all arguments converted during string formatting", true},
    {"pct_err_type", "{{ '%d' % 'a' }}", "{}", "t:1: %d format: a real number is required, not str",
     true},
    {"pct_err_char", "{{ '%y' % 1 }}", "{}",
     "t:1: unsupported format character 'y' (0x79) at index 1", true},
    {"pct_err_map", "{{ '%(a)s' % (1,) }}", "{}", "t:1: format requires a mapping", true},
    {"pct_err_hex_float", "{{ '%x' % 1.5 }}", "{}",
     "t:1: %x format: an integer is required, not float", true},
    {"pct_err_incomplete", "{{ 'abc %' % () }}", "{}", "t:1: incomplete format", true},
    {"pct_undefined", "[{{ '%s' % nope }}]", "{}", "[]", false},
    {"pct_int_mod", "{{ 7 % 3 }} {{ x % 2 }}", "{\"x\": 5}", "1 1", false},
    {"groupby_basic",
     "{% for g in msgs|groupby('role') %}{{ g.grouper }}={{ g.list|map(attribute='c')|join(',') "
     "}};{% endfor %}",
     "{\"msgs\": [{\"role\": \"user\", \"c\": \"a\"}, {\"role\": \"asst\", \"c\": \"b\"}, "
     "{\"role\": \"user\", \"c\": \"d\"}]}",
     "asst=b;user=a,d;", false},
    {"groupby_unpack",
     "{% for k, items in msgs|groupby('role') %}{{ k }}:{{ items|length }} {% endfor %}",
     "{\"msgs\": [{\"role\": \"b\"}, {\"role\": \"a\"}, {\"role\": \"b\"}]}", "a:1 b:2 ", false},
    {"groupby_case",
     "{% for g in xs|groupby('n') %}{{ g.grouper }}{{ g.list|length }} {% endfor %}|{% for g in "
     "xs|groupby('n', case_sensitive=true) %}{{ g.grouper }}{{ g.list|length }} {% endfor %}",
     "{\"xs\": [{\"n\": \"a\"}, {\"n\": \"A\"}, {\"n\": \"b\"}]}", "a2 b1 |A1 a1 b1 ", false},
    {"groupby_default",
     "{% for g in xs|groupby('t', default='none') %}{{ g[0] }}:{{ g[1]|length }} {% endfor %}",
     "{\"xs\": [{\"t\": \"x\"}, {}, {\"t\": \"x\"}]}", "none:1 x:2 ", false},
    {"groupby_dotted",
     "{% for g in xs|groupby('a.b') %}{{ g.grouper }}{% endfor %}|{{ "
     "(xs|groupby('a.b')|list|length) }}",
     "{\"xs\": [{\"a\": {\"b\": 2}}, {\"a\": {\"b\": 1}}]}", "12|2", false},
    {"batch_basic",
     "{{ [1,2,3,4,5]|batch(2)|list }}|{{ [1,2,3,4,5]|batch(2, 'x')|list }}|{{ []|batch(3)|list }}",
     "{}", "[[1, 2], [3, 4], [5]]|[[1, 2], [3, 4], [5, 'x']]|[]", false},
    {"slice_basic",
     "{{ [1,2,3,4,5,6,7]|slice(3)|list }}|{{ [1,2,3,4,5,6,7]|slice(3, 0)|list }}|{{ "
     "[1,2]|slice(4)|list }}",
     "{}", "[[1, 2, 3], [4, 5], [6, 7]]|[[1, 2, 3], [4, 5, 0], [6, 7, 0]]|[[1], [2], [], []]",
     false},
    {"truncate_basic",
     "{{ 'The quick brown fox jumps over'|truncate(15) }}|{{ 'The quick brown fox "
     "jumps'|truncate(15, true) }}|{{ 'abcdefghij'|truncate(8, end='..', leeway=0) }}|{{ "
     "'short'|truncate(3) }}",
     "{}", "The quick...|The quick br...|abcdef..|short", false},
    {"truncate_leeway",
     "{{ 'hello world foo'|truncate(12) }}|{{ 'hello world foo bar baz'|truncate(12, leeway=0) "
     "}}|{{ 'nospaceshereatall'|truncate(8, leeway=0) }}|{{ '\xc3\xa9"
     "\xc3\xa9"
     "\xc3\xa9"
     "\xc3\xa9"
     "\xc3\xa9"
     "\xc3\xa9"
     "\xc3\xa9"
     "\xc3\xa9"
     "\xc3\xa9"
     "\xc3\xa9"
     "'|truncate(5, true, '!', 0) }}",
     "{}",
     "hello world foo|hello...|nospa...|\xc3\xa9"
     "\xc3\xa9"
     "\xc3\xa9"
     "\xc3\xa9"
     "!",
     false},
    {"truncate_err", "{{ 'abc'|truncate(2) }}", "{}", "t:1: expected length >= 3, got 2", true},
    {"truncate_err_leeway", "{{ 'abcdefgh'|truncate(5, leeway=-1) }}", "{}",
     "t:1: expected leeway >= 0, got -1", true},
    {"call_basic",
     "{% macro box(t) %}[{{ t }}:{{ caller() }}]{% endmacro %}{% call box('x') %}inner {{ v }}{% "
     "endcall %}",
     "{\"v\": 1}", "[x:inner 1]", false},
    {"call_args",
     "{% macro each(xs) %}{% for x in xs %}{{ caller(x, loop.index) }}{% endfor %}{% endmacro %}{% "
     "call(item, i) each(['a', 'b']) %}{{ i }}={{ item }};{% endcall %}",
     "{}", "1=a;2=b;", false},
    {"call_ws",
     "{% macro wrap() %}\n<{{ caller() }}>\n{% endmacro %}\n{% call wrap() %}\n  body\n{% endcall "
     "%}\nend",
     "{}", "<  body\n>\nend", false},
    {"call_nested",
     "{% macro a() %}a({{ caller() }}){% endmacro %}{% macro b() %}b({{ caller() }}){% endmacro "
     "%}{% call a() %}{% call b() %}x{% endcall %}{% endcall %}",
     "{}", "a(b(x))", false},
    {"call_twice",
     "{% macro twice() %}{{ caller() }}{{ caller() }}{% endmacro %}{% call twice() %}{% set y = 1 "
     "%}z{% endcall %}",
     "{}", "zz", false},
    {"call_default_param",
     "{% macro m() %}{{ caller() }}|{{ caller(5) }}{% endmacro %}{% call(x=2) m() %}{{ x }}{% "
     "endcall %}",
     "{}", "2|5", false},
    {"call_scope",
     "{% set s = 'outer' %}{% macro m() %}{% set s = 'macro' %}{{ caller() }}{% endmacro %}{% call "
     "m() %}{{ s }}{% endcall %}",
     "{}", "outer", false},
    {"call_kw",
     "{% macro m(a, b=2) %}{{ a }}{{ b }}{{ caller() }}{% endmacro %}{% call m(b=3, a=1) %}!{% "
     "endcall %}",
     "{}", "13!", false},
    {"call_err_nocaller", "{% macro m() %}x{% endmacro %}{% call m() %}y{% endcall %}", "{}",
     "t:1: macro 'm' takes no keyword argument 'caller'", true},
    {"call_err_undefined", "{% macro m() %}{{ caller() }}{% endmacro %}{{ m() }}", "{}",
     "t:1: 'caller' is undefined", true},
    {"call_err_not_call", "{% call foo %}x{% endcall %}", "{}", "t:1: expected call", true},
    {"call_err_unclosed", "{% macro m() %}{{ caller() }}{% endmacro %}{% call m() %}x", "{}",
     "t:1: unexpected end of template: the 'call' block needs '{% endcall %}'", true},
    {"call_loop_break",
     "{% macro m() %}{{ caller() }}{% endmacro %}{% for i in [1,2] %}{% call m() %}{{ i }}{% "
     "endcall %}{% endfor %}",
     "{}", "12", false},
    {"macro_varargs",
     "{% macro m(a) %}{{ a }}{{ varargs }}{{ varargs|length }}{% endmacro %}{{ m(1, 2, 3) }}|{{ "
     "m(1) }}",
     "{}", "1(2, 3)2|1()0", false},
    {"macro_kwargs",
     "{% macro m(a) %}{{ a }}{{ kwargs }}{% endmacro %}{{ m(1, x=2, y='z') }}|{{ m(a=1) }}", "{}",
     "1{'x': 2, 'y': 'z'}|1{}", false},
    {"macro_err_extra", "{% macro m(a) %}{{ a }}{% endmacro %}{{ m(1, 2) }}", "{}",
     "t:1: macro 'm' takes not more than 1 argument(s)", true},
    {"macro_err_kw", "{% macro m(a) %}{{ a }}{% endmacro %}{{ m(1, x=2) }}", "{}",
     "t:1: macro 'm' takes no keyword argument 'x'", true},
};

/* ---- helpers -------------------------------------------------------------------------------- */

/* Prints where two strings first differ, with context, and fails. */
static void fail_diff(const char *what, const char *want, size_t wn, const char *got, size_t gn) {
  size_t i = 0;
  while (i < wn && i < gn && want[i] == got[i]) i++;
  size_t from = i > 40 ? i - 40 : 0;
  char a[400], b[400];
  size_t ka = 0, kb = 0;
  for (size_t k = from; k < wn && k < i + 40 && ka < sizeof a - 5; k++)
    ka += (size_t)snprintf(a + ka, sizeof a - ka, (unsigned char)want[k] < 32 ? "\\x%02x" : "%c",
                           want[k]);
  for (size_t k = from; k < gn && k < i + 40 && kb < sizeof b - 5; k++)
    kb += (size_t)snprintf(b + kb, sizeof b - kb, (unsigned char)got[k] < 32 ? "\\x%02x" : "%c",
                           got[k]);
  fail_msg(
      "%s: output differs at byte %zu (want %zu bytes, got %zu)\n  want: ...%s...\n  got:  "
      "...%s...",
      what, i, wn, gn, a, b);
}

/* Compiles src as "t" and renders it with vars_json (an object whose members are variables;
 * messages/tools/add_generation_prompt are taken from it too). Returns the output (malloc'd) or
 * NULL with *out_st set. */
static char *render(const char *src, const char *vars_json, const kiln_template_limits_t *lim,
                    kiln_status_t *out_st, size_t *out_len) {
  kiln_json_doc_t *doc = NULL;
  kiln_template_t *t = NULL;
  kiln_strbuf_t out = KILN_STRBUF_INIT;
  char *res = NULL;
  kiln_status_t st = kiln_json_parse(vars_json, strlen(vars_json), "vars", &doc);
  if (st) fail_msg("bad vars JSON: %s", kiln_status_message(st));
  const kiln_json_t *v = kiln_json_root(doc);
  st = kiln_template_compile(src, strlen(src), "t", &t);
  if (!st) {
    kiln_template_vars_t vars = {
        .messages = kiln_json_get(v, "messages"),
        .tools = kiln_json_get(v, "tools"),
        .add_generation_prompt = kiln_json_bool(kiln_json_get(v, "add_generation_prompt")),
        .extra = v,
        .limits = lim,
    };
    st = kiln_template_render(t, &vars, &out);
    /* a compiled template renders the same twice */
    if (!st) {
      kiln_strbuf_t again = KILN_STRBUF_INIT;
      kiln_status_t st2 = kiln_template_render(t, &vars, &again);
      assert_null(st2);
      assert_int_equal(again.len, out.len);
      assert_memory_equal(kiln_strbuf_cstr(&again), kiln_strbuf_cstr(&out), out.len);
      kiln_strbuf_free(&again);
    }
  }
  if (!st) res = kiln_strbuf_detach(&out, out_len);
  kiln_strbuf_free(&out);
  kiln_template_free(t);
  kiln_json_doc_free(doc);
  *out_st = st;
  return res;
}

static void expect_output(const char *src, const char *vars, const char *want) {
  kiln_status_t st;
  size_t n = 0;
  char *got = render(src, vars, NULL, &st, &n);
  if (st) fail_msg("%s: unexpected error: %s", src, kiln_status_message(st));
  if (n != strlen(want) || memcmp(got, want, n) != 0) fail_diff(src, want, strlen(want), got, n);
  free(got);
}

/* Expects an error whose message contains every fragment (NULL-terminated list). */
static void expect_error(const char *src, const char *vars, const kiln_template_limits_t *lim,
                         const char *fragment, const char *fragment2) {
  kiln_status_t st;
  size_t n;
  char *got = render(src, vars, lim, &st, &n);
  if (!st) fail_msg("%.60s: expected an error, got \"%.200s\"", src, got);
  const char *msg = kiln_status_message(st);
  if (!strstr(msg, fragment) || (fragment2 && !strstr(msg, fragment2)))
    fail_msg("%.60s: error \"%s\" lacks \"%s\"%s%s", src, msg, fragment, fragment2 ? " / " : "",
             fragment2 ? fragment2 : "");
  kiln_status_free(st);
}

/* ---- tests ---------------------------------------------------------------------------------- */

static void test_feature_table(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof k_cases / sizeof *k_cases; i++) {
    const tt_case_t *c = &k_cases[i];
    kiln_status_t st;
    size_t n = 0;
    char *got = render(c->src, c->vars, NULL, &st, &n);
    if (c->error) {
      if (!st) fail_msg("%s: expected error \"%s\", got \"%s\"", c->name, c->expected, got);
      if (strcmp(kiln_status_message(st), c->expected) != 0)
        fail_msg("%s: error\n  want: %s\n  got:  %s", c->name, c->expected,
                 kiln_status_message(st));
      assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
      kiln_status_free(st);
      continue;
    }
    if (st) fail_msg("%s: unexpected error: %s", c->name, kiln_status_message(st));
    if (n != strlen(c->expected) || memcmp(got, c->expected, n) != 0)
      fail_diff(c->name, c->expected, strlen(c->expected), got, n);
    free(got);
  }
}

static void test_error_lines(void **state) {
  (void)state;
  /* syntax errors fail at compile time with the line of the offending token */
  kiln_template_t *t = NULL;
  const char *bad = "line1\n{% if x %}\n{{ 1 + }}\n{% endif %}";
  kiln_status_t st = kiln_template_compile(bad, strlen(bad), "chat_template", &t);
  assert_non_null(st);
  assert_null(t);
  assert_string_equal(kiln_status_message(st),
                      "chat_template:3: unexpected end of print statement");
  kiln_status_free(st);
  const char *unknown = "a\nb\n{{ x | frobnicate }}";
  st = kiln_template_compile(unknown, strlen(unknown), "chat_template", &t);
  assert_non_null(st);
  assert_string_equal(kiln_status_message(st), "chat_template:3: unknown filter 'frobnicate'");
  kiln_status_free(st);
  /* runtime errors carry the line of the expression */
  expect_error(
      "{% for m in messages %}\n{% if m.role == 'bad' %}\n{{ raise_exception('Bad role: ' ~ "
      "m.role) }}\n{% endif %}{% endfor %}",
      "{\"messages\": [{\"role\": \"user\"}, {\"role\": \"bad\"}]}", NULL, "t:3: Bad role: bad",
      NULL);
  expect_error("\n\n\n{{ messages[0].content.nope() }}", "{\"messages\": [{\"content\": \"x\"}]}",
               NULL, "t:4: ", "nope");
  expect_error("{{ 'x' }}\n{% for x in 3 %}{% endfor %}", "{}", NULL,
               "t:2: 'int' object is not iterable", NULL);
  expect_error("{% if true %}\n{% for x in y %}\n", "{}", NULL, "t:2: unexpected end of template",
               "endfor");
  expect_error("{% endif %}", "{}", NULL, "t:1: unexpected 'endif'", NULL);
  expect_error("{% include 'x' %}", "{}", NULL, "t:1: the 'include' tag is not supported", NULL);
  expect_error("{{ '{:n}'.format(1) }}", "{}", NULL, "t:1: the 'n' format type is not supported",
               NULL);
  expect_error("{% break %}", "{}", NULL, "t:1: 'break' outside of a loop", NULL);
  expect_error("{{ dict.update }}{% set d = {'a': 1} %}{{ d.update({'b': 2}) }}", "{}", NULL,
               "t:1: access to attribute 'update' of 'dict' object is unsafe.", NULL);
  expect_error("{{ 9223372036854775807 + 1 }}", "{}", NULL, "t:1: integer overflow", NULL);
  expect_error("{{ m.x.y }}", "{\"m\": {}}", NULL, "t:1: 'dict object' has no attribute 'x'", NULL);
  /* an unknown filter inside an if fails only when that branch runs, as in Jinja */
  expect_output("{% if false %}{{ 1 | frobnicate }}{% endif %}ok", "{}", "ok");
  expect_error("{% if true %}{{ 1 | frobnicate }}{% endif %}", "{}", NULL,
               "t:1: unknown filter 'frobnicate'", NULL);
}

static void test_limits(void **state) {
  (void)state;
  kiln_template_limits_t lim = {.max_iterations = 1000};
  expect_error("{% for i in range(100) %}{% for j in range(100) %}{% endfor %}{% endfor %}", "{}",
               &lim, "t:1: more than 1000 loop iterations", NULL);
  expect_error("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "{}", NULL,
               "recursion too deep", NULL);
  lim = (kiln_template_limits_t){.max_output = 100};
  expect_error("{% for i in range(1000) %}xxxxxxxxxx{% endfor %}", "{}", &lim,
               "output is larger than the limit of 100 bytes", NULL);
  expect_error("{{ 'x' * 1000 }}", "{}", &lim, "string repetition result is too large", NULL);
  expect_error("{{ '{:>2000000}'.format(1) }}", "{}", NULL, "format width 2000000 is larger", NULL);
  expect_error("{{ '%2000000d' % 1 }}", "{}", NULL, "format width 2000000 is larger", NULL);
  expect_error("{{ '{:2000}'.format(1) }}", "{}", &lim, "output is larger than the limit", NULL);
  expect_error(
      "{% macro m() %}{% call m() %}{% endcall %}{{ caller() }}{% endmacro %}"
      "{% call m() %}{% endcall %}",
      "{}", NULL, "recursion too deep", NULL);
  lim = (kiln_template_limits_t){.max_memory = 8u << 20};
  expect_error(
      "{% set ns = namespace(s='xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx') %}{% for i in range(40) %}{% "
      "set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}",
      "{}", &lim, "memory limit", NULL);
  /* hostile nesting is a syntax error, not a stack overflow */
  char deep[8200];
  size_t k = 0;
  k += (size_t)snprintf(deep + k, sizeof deep - k, "{{ ");
  for (int i = 0; i < 2000; i++) deep[k++] = '(';
  deep[k++] = '1';
  for (int i = 0; i < 2000; i++) deep[k++] = ')';
  snprintf(deep + k, sizeof deep - k, " }}");
  expect_error(deep, "{}", NULL, "nested too deeply", NULL);
  k = 0;
  k += (size_t)snprintf(deep + k, sizeof deep - k, "{{ ");
  for (int i = 0; i < 3000; i++) k += (size_t)snprintf(deep + k, sizeof deep - k, "-");
  snprintf(deep + k, sizeof deep - k, "1 }}");
  expect_error(deep, "{}", NULL, "nested too deeply", NULL);
  k = 0;
  for (int i = 0; i < 600; i++) k += (size_t)snprintf(deep + k, sizeof deep - k, "{%% if 1 %%}");
  expect_error(deep, "{}", NULL, "unexpected end of template", NULL);
  /* the default limits leave ordinary templates alone */
  expect_output("{% for i in range(3000) %}{% endfor %}{{ range(100000) | length }}", "{}",
                "100000");
}

static void test_vars(void **state) {
  (void)state;
  /* JSON values keep Python types: ints, floats, null, nested containers */
  expect_output("{{ m }}", "{\"m\": {\"a\": [1, 2.5, null, true, \"s\"], \"b\": {}}}",
                "{'a': [1, 2.5, None, True, 's'], 'b': {}}");
  /* the fixed variables: messages/tools default to None, add_generation_prompt to False */
  kiln_template_t *t = NULL;
  const char *src =
      "{{ messages }}|{{ tools }}|{{ documents }}|{{ add_generation_prompt }}|{{ bos_token }}|{{ x "
      "}}";
  assert_null(kiln_template_compile(src, strlen(src), "t", &t));
  kiln_template_string_var_t strs[] = {{"bos_token", "<s>"}, {"x", "from-strings"}};
  kiln_json_doc_t *doc = NULL;
  const char *extra = "{\"x\": \"from-extra\", \"messages\": \"ignored\"}";
  assert_null(kiln_json_parse(extra, strlen(extra), "extra", &doc));
  kiln_template_vars_t vars = {.strings = strs, .n_strings = 2, .extra = kiln_json_root(doc)};
  kiln_strbuf_t out = KILN_STRBUF_INIT;
  assert_null(kiln_template_render(t, &vars, &out));
  assert_string_equal(kiln_strbuf_cstr(&out), "None|None|None|False|<s>|from-extra");
  /* NULL vars work too */
  kiln_strbuf_reset(&out);
  assert_null(kiln_template_render(t, NULL, &out));
  assert_string_equal(kiln_strbuf_cstr(&out), "None|None|None|False||");
  kiln_strbuf_free(&out);
  kiln_json_doc_free(doc);
  kiln_template_free(t);
  /* strftime_now formats the current time */
  kiln_status_t st;
  size_t n;
  char *got = render("{{ strftime_now('%Y') | length }}", "{}", NULL, &st, &n);
  assert_null(st);
  assert_string_equal(got, "4");
  free(got);
}

/* ---- the loader ----------------------------------------------------------------------------- */

static void write_file(const char *dir, const char *name, const char *text) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
}

static void rm_dir(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *e;
  char path[1024];
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    if (unlink(path) != 0) rm_dir(path);
  }
  closedir(d);
  rmdir(dir);
}

static char *render_ct(const kiln_chat_template_t *ct, const char *msgs_json, bool with_tools,
                       kiln_status_t *out_st) {
  kiln_json_doc_t *doc = NULL;
  assert_null(kiln_json_parse(msgs_json, strlen(msgs_json), "m", &doc));
  kiln_json_doc_t *tdoc = NULL;
  assert_null(kiln_json_parse("[]", 2, "t", &tdoc));
  kiln_template_vars_t vars = {.messages = kiln_json_root(doc),
                               .tools = with_tools ? kiln_json_root(tdoc) : NULL,
                               .add_generation_prompt = true};
  kiln_strbuf_t out = KILN_STRBUF_INIT;
  *out_st = kiln_chat_template_render(ct, &vars, &out);
  char *res = *out_st ? NULL : kiln_strbuf_detach(&out, NULL);
  kiln_strbuf_free(&out);
  kiln_json_doc_free(doc);
  kiln_json_doc_free(tdoc);
  return res;
}

static void test_loader(void **state) {
  (void)state;
  char dir[] = "/tmp/kiln_tpl_test_XXXXXX";
  assert_non_null(mkdtemp(dir));
  kiln_chat_template_t *ct = NULL;
  kiln_status_t st;
  const char *msgs = "[{\"role\": \"user\", \"content\": \"hi\"}]";

  /* no template at all */
  write_file(dir, "tokenizer_config.json", "{\"bos_token\": \"<s>\"}");
  st = kiln_chat_template_load(dir, &ct);
  assert_int_equal(kiln_status_code(st), KILN_ERR_NOT_FOUND);
  assert_non_null(strstr(kiln_status_message(st), "no chat template"));
  assert_null(ct);
  kiln_status_free(st);

  /* a string template; special tokens as strings or AddedToken objects */
  write_file(dir, "tokenizer_config.json",
             "{\"chat_template\": \"{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% "
             "endfor %}{{ eos_token }}{{ pad_token }}\","
             " \"bos_token\": {\"content\": \"<B>\", \"lstrip\": false}, \"eos_token\": \"<E>\", "
             "\"pad_token\": null}");
  assert_null(kiln_chat_template_load(dir, &ct));
  char *out = render_ct(ct, msgs, false, &st);
  assert_null(st);
  assert_string_equal(out, "<B>[hi]<E>");
  free(out);
  size_t ns;
  const kiln_template_string_var_t *sv = kiln_chat_template_strings(ct, &ns);
  assert_int_equal(ns, 2);
  assert_string_equal(sv[0].name, "bos_token");
  kiln_chat_template_free(ct);

  /* the list form: tool_use is picked when tools are given (even an empty list) */
  write_file(dir, "tokenizer_config.json",
             "{\"chat_template\": [{\"name\": \"default\", \"template\": \"D\"},"
             " {\"name\": \"tool_use\", \"template\": \"T{{ tools | length }}\"}]}");
  assert_null(kiln_chat_template_load(dir, &ct));
  out = render_ct(ct, msgs, false, &st);
  assert_string_equal(out, "D");
  free(out);
  out = render_ct(ct, msgs, true, &st);
  assert_string_equal(out, "T0");
  free(out);
  assert_non_null(kiln_chat_template_get(ct, "tool_use"));
  assert_null(kiln_chat_template_get(ct, "nope"));
  kiln_chat_template_free(ct);

  /* the list form without a default: an error when no tools select tool_use */
  write_file(dir, "tokenizer_config.json",
             "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T\"}]}");
  assert_null(kiln_chat_template_load(dir, &ct));
  out = render_ct(ct, msgs, false, &st);
  assert_int_equal(kiln_status_code(st), KILN_ERR_NOT_FOUND);
  kiln_status_free(st);
  kiln_chat_template_free(ct);

  /* a syntax error is reported at load with the template's name and line */
  write_file(dir, "tokenizer_config.json", "{\"chat_template\": \"ok\\n{% for %}\"}");
  st = kiln_chat_template_load(dir, &ct);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(kiln_status_message(st), "chat_template:2: "));
  kiln_status_free(st);

  /* a malformed entry */
  write_file(dir, "tokenizer_config.json", "{\"chat_template\": [{\"name\": \"default\"}]}");
  st = kiln_chat_template_load(dir, &ct);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  kiln_status_free(st);
  write_file(dir, "tokenizer_config.json", "{\"chat_template\": 5}");
  st = kiln_chat_template_load(dir, &ct);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  kiln_status_free(st);
  write_file(dir, "tokenizer_config.json", "{\"chat_template\": ");
  st = kiln_chat_template_load(dir, &ct);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  kiln_status_free(st);

  /* chat_template.jinja takes precedence over the config; its trailing newline is dropped */
  write_file(dir, "tokenizer_config.json",
             "{\"chat_template\": \"config\", \"eos_token\": \"</s>\"}");
  write_file(dir, "chat_template.jinja", "file{{ eos_token }}\n");
  assert_null(kiln_chat_template_load(dir, &ct));
  out = render_ct(ct, msgs, false, &st);
  assert_string_equal(out, "file</s>");
  free(out);
  kiln_chat_template_free(ct);

  /* a template file with no tokenizer_config.json at all */
  char path[512];
  snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
  unlink(path);
  assert_null(kiln_chat_template_load(dir, &ct));
  kiln_chat_template_free(ct);

  st = kiln_chat_template_load("/nonexistent/kiln", &ct);
  assert_int_equal(kiln_status_code(st), KILN_ERR_NOT_FOUND);
  kiln_status_free(st);
  rm_dir(dir);
}

/* ---- goldens from transformers -------------------------------------------------------------- */

/* Special tokens of DIR/tokenizer_config.json (for inline "source" cases, whose directory may have
 * no template). Strings are borrowed from *out_doc. */
static size_t config_strings(const char *dir, kiln_json_doc_t **out_doc,
                             kiln_template_string_var_t *sv) {
  static const char *const names[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                      "pad_token", "cls_token", "mask_token"};
  char path[2048];
  size_t n = 0;
  snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
  kiln_status_t st = kiln_json_parse_file(path, out_doc);
  if (st) fail_msg("%s", kiln_status_message(st));
  const kiln_json_t *cfg = kiln_json_root(*out_doc);
  for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
    const kiln_json_t *v = kiln_json_get(cfg, names[i]);
    if (kiln_json_is(v, KILN_JSON_OBJECT)) v = kiln_json_get(v, "content");
    if (kiln_json_string(v, NULL))
      sv[n++] = (kiln_template_string_var_t){names[i], kiln_json_string(v, NULL)};
  }
  return n;
}

/* Runs one golden line; returns false (after printing why) on a mismatch. */
static bool golden_line(const char *cache, const char *file, int lineno, const kiln_json_t *c,
                        size_t *skipped) {
  char where[600], dir[1024];
  const char *tname = kiln_json_string(kiln_json_get(c, "template"), NULL);
  size_t srclen = 0;
  const char *source = kiln_json_string(kiln_json_get(c, "source"), &srclen);
  const kiln_json_t *want = kiln_json_get(c, "rendered"), *want_err = kiln_json_get(c, "error");
  snprintf(where, sizeof where, "%s:%d (%s%s)", file, lineno, tname ? tname : "?",
           source ? ", inline source" : "");
  if (!want && !want_err) {
    (*skipped)++;
    return true;
  }
  if (!tname) {
    print_error("%s: no \"template\"\n", where);
    return false;
  }
  snprintf(dir, sizeof dir, "%s/%s", cache, tname);
  kiln_template_vars_t vars = {
      .messages = kiln_json_get(c, "messages"),
      .tools = kiln_json_get(c, "tools"),
      .documents = kiln_json_get(c, "documents"),
      .add_generation_prompt = kiln_json_bool(kiln_json_get(c, "add_generation_prompt")),
      .extra = kiln_json_get(c, "extra"),
  };
  kiln_strbuf_t out = KILN_STRBUF_INIT;
  kiln_status_t st = NULL;
  if (source) {
    kiln_json_doc_t *cfg = NULL;
    kiln_template_string_var_t sv[8];
    kiln_template_t *t = NULL;
    vars.strings = sv;
    vars.n_strings = config_strings(dir, &cfg, sv);
    st = kiln_template_compile(source, srclen, "source", &t);
    if (!st) st = kiln_template_render(t, &vars, &out);
    kiln_template_free(t);
    kiln_json_doc_free(cfg);
  } else {
    kiln_chat_template_t *ct = NULL;
    st = kiln_chat_template_load(dir, &ct);
    if (!st) st = kiln_chat_template_render(ct, &vars, &out);
    kiln_chat_template_free(ct);
  }
  bool ok = true;
  if (want_err) {
    if (!st) {
      print_error("%s: transformers raised \"%s\", Kiln rendered \"%.200s\"\n", where,
                  kiln_json_string(want_err, NULL), kiln_strbuf_cstr(&out));
      ok = false;
    }
  } else if (st) {
    print_error("%s: Kiln failed: %s\n", where, kiln_status_message(st));
    ok = false;
  } else {
    size_t wn = 0;
    const char *w = kiln_json_string(want, &wn);
    if (wn != out.len || memcmp(w, kiln_strbuf_cstr(&out), wn) != 0) {
      size_t i = 0;
      const char *g = kiln_strbuf_cstr(&out);
      while (i < wn && i < out.len && w[i] == g[i]) i++;
      size_t from = i > 60 ? i - 60 : 0;
      print_error(
          "%s: output differs at byte %zu (want %zu bytes, got %zu)\n  want: ...%.*s...\n  got:  "
          "...%.*s...\n",
          where, i, wn, out.len, (int)((wn < i + 60 ? wn : i + 60) - from), w + from,
          (int)((out.len < i + 60 ? out.len : i + 60) - from), g + from);
      ok = false;
    }
  }
  kiln_status_free(st);
  kiln_strbuf_free(&out);
  return ok;
}

static void test_goldens(void **state) {
  (void)state;
  const char *cache = getenv("KILN_TOKENIZER_CACHE");
  if (!cache || !*cache) {
    print_message(
        "[  SKIPPED ] goldens: KILN_TOKENIZER_CACHE is not set (tests/fetch_tokenizers.sh)\n");
    skip();
  }
  char gdir[1024];
  const char *override = getenv("KILN_TEMPLATE_GOLDENS");
  const char *src = getenv("KILN_SOURCE_DIR");
  if (override && *override)
    snprintf(gdir, sizeof gdir, "%s", override);
  else
    snprintf(gdir, sizeof gdir, "%s/tests/data/templates", src ? src : ".");
  DIR *d = opendir(gdir);
  if (!d) fail_msg("cannot open the golden directory %s", gdir);
  size_t cases = 0, failed = 0, skipped = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    size_t l = strlen(e->d_name);
    if (l < 7 || strcmp(e->d_name + l - 6, ".jsonl") != 0) continue;
    char path[2048];
    snprintf(path, sizeof path, "%s/%s", gdir, e->d_name);
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot open %s", path);
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    int lineno = 0;
    while ((n = getline(&line, &cap, f)) > 0) {
      lineno++;
      if (n <= 1) continue;
      kiln_json_doc_t *doc = NULL;
      kiln_status_t st = kiln_json_parse(line, (size_t)n, e->d_name, &doc);
      if (st) fail_msg("%s:%d: %s", path, lineno, kiln_status_message(st));
      cases++;
      if (!golden_line(cache, e->d_name, lineno, kiln_json_root(doc), &skipped)) failed++;
      kiln_json_doc_free(doc);
    }
    free(line);
    fclose(f);
  }
  closedir(d);
  print_message("[ GOLDENS  ] %zu lines, %zu matched, %zu failed, %zu without an expected output\n",
                cases, cases - failed - skipped, failed, skipped);
  if (failed) fail_msg("%zu golden chat prompts differ from transformers", failed);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_feature_table), cmocka_unit_test(test_error_lines),
      cmocka_unit_test(test_limits),        cmocka_unit_test(test_vars),
      cmocka_unit_test(test_loader),        cmocka_unit_test(test_goldens),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
