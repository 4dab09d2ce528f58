// The form table (server/core/form_table.h) against what it stands for: attnserve.v1.Form on the
// wire, and each form's materialisation for the parameter count and the head combination.
#include <gtest/gtest.h>

#include <cctype>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "server/core/form_table.h"
#include "server/core/forms.h"
#include "server/core/layer.h"
#include "tests/unit/test_support.h"

namespace attnserve {
namespace {

std::string Upper(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

TEST(FormTableTest, EveryWireFormHasOneRowAndEveryRowIsOnTheWire) {
  const google::protobuf::EnumDescriptor* wire = v1::Form_descriptor();
  std::set<int> rows_seen;
  std::string expected_names;
  for (int i = 0; i < wire->value_count(); ++i) {
    const int number = wire->value(i)->number();
    if (number == v1::FORM_UNSPECIFIED) {
      EXPECT_EQ(DefOfWire(number), nullptr) << "FORM_UNSPECIFIED is no form: the router decides";
      continue;
    }
    if (number == v1::FORM_AUTO) {
      EXPECT_EQ(DefOfWire(number), nullptr) << "FORM_AUTO is no form: the cost model picks one";
      EXPECT_EQ(kAutoChoice.wire, number);
      EXPECT_EQ("FORM_" + Upper(kAutoChoice.name), wire->value(i)->name());
      EXPECT_EQ(DefNamed(kAutoChoice.name), nullptr);
      continue;
    }
    const FormDef* def = DefOfWire(number);
    ASSERT_NE(def, nullptr) << wire->value(i)->name() << " has no row in kFormTable";
    EXPECT_EQ("FORM_" + Upper(def->name), wire->value(i)->name()) << "the row's name is the wire name's";
    rows_seen.insert(number);
    expected_names += (expected_names.empty() ? "" : ", ") + wire->value(i)->name();
  }
  EXPECT_EQ(rows_seen.size(), std::size(kFormTable)) << "a row whose wire value attnserve.v1.Form lacks";
  const size_t last = expected_names.rfind(", ");
  ASSERT_NE(last, std::string::npos);
  expected_names.replace(last, 2, " or ");
  EXPECT_EQ(WireFormNames(), expected_names);
  EXPECT_EQ(WireChoiceNames(), "FORM_FACTORED, FORM_SUMMED, FORM_LOWRANK or FORM_AUTO");
}

TEST(FormTableTest, RowsAreFoundByFormNameAndWire) {
  std::set<std::string_view> names;
  for (Form form : kAllForms) {
    const FormDef& def = DefOf(form);
    EXPECT_EQ(def.form, form);
    EXPECT_EQ(FormName(form), def.name);
    EXPECT_EQ(ParseForm(def.name), form);
    EXPECT_EQ(DefNamed(def.name), &def);
    EXPECT_EQ(DefOfWire(def.wire), &def);
    EXPECT_EQ(HeadCombineOf(form), def.combine);
    EXPECT_TRUE(names.insert(def.name).second) << "two rows named " << def.name;
    EXPECT_NE(FormNames().find(def.name), std::string::npos);
  }
  EXPECT_EQ(ParseForm("Summed"), std::nullopt);
  EXPECT_EQ(ParseForm("auto"), std::nullopt) << "auto is the cost model's choice, not a form";
  EXPECT_EQ(WireFormNames().find("AUTO"), std::string::npos) << "the forms' names, which a layer may hold";
  EXPECT_EQ(DefNamed(""), nullptr);
  EXPECT_EQ(DefOfWire(-1), nullptr);
  EXPECT_EQ(DefOfWire(v1::FORM_AUTO + 1), nullptr);
}

// The size a load checks before materialising is what the materialised form holds, and each
// form's weights agree with how its row says the heads combine.
TEST(FormTableTest, ParameterFormulaAndHeadCombineMatchTheMaterialisedForm) {
  std::mt19937_64 rng(testing::TestSeed());
  for (int trial = 0; trial < 24; ++trial) {
    LayerConfig c;
    c.kv_heads = std::uniform_int_distribution<int64_t>(1, 3)(rng);
    c.heads = c.kv_heads * std::uniform_int_distribution<int64_t>(1, 3)(rng);
    c.d_head = std::uniform_int_distribution<int64_t>(1, 9)(rng);
    c.d_model = std::uniform_int_distribution<int64_t>(2, 24)(rng);
    c.bias = trial % 2 == 0;
    const LayerWeights w = RandomLayerWeights(c, rng());
    std::vector<int64_t> ranks;
    int64_t total = 0;
    for (int64_t i = 0; i < c.heads; ++i) {
      ranks.push_back(std::uniform_int_distribution<int64_t>(1, std::min(c.d_model, c.d_head))(rng));
      total += ranks.back();
    }
    for (const FormDef& def : kFormTable) {
      SCOPED_TRACE(std::string(def.name) + " " + c.ToString());
      auto f = def.materialize(w, ranks);
      ASSERT_TRUE(f.ok()) << f.status().ToString();
      EXPECT_EQ(f->form, def.form);
      EXPECT_EQ(FormParameters(def.form, c, total), f->Parameters());
      EXPECT_EQ(f->head_combine(), def.combine);
      EXPECT_TRUE(CheckHeadCombine(*f).ok()) << CheckHeadCombine(*f).ToString();
    }
  }
}

}  // namespace
}  // namespace attnserve
