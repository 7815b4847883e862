#include <gtest/gtest.h>

#include "common/did_you_mean.hpp"
#include "common/format.hpp"

using namespace ds;

TEST(FormatBytes, UsesBinaryUnitsWithTheirNames) {
  EXPECT_EQ(format_bytes(100), "100 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(13476831232.0), "12.55 GiB");
  EXPECT_EQ(format_gib(524288000.0), "0.49");
}

TEST(FormatCount, GroupsThousands) {
  EXPECT_EQ(format_count(124439808), "124,439,808");
  EXPECT_EQ(format_count(999), "999");
  EXPECT_EQ(format_count(-1000), "-1,000");
}

TEST(ParseBytes, AcceptsBinaryAndDecimalUnits) {
  double b = 0;
  ASSERT_TRUE(parse_bytes("80GiB", &b));
  EXPECT_DOUBLE_EQ(b, 80.0 * 1073741824.0);
  ASSERT_TRUE(parse_bytes("40 GB", &b));
  EXPECT_DOUBLE_EQ(b, 40e9);
  ASSERT_TRUE(parse_bytes("1.5T", &b));
  EXPECT_DOUBLE_EQ(b, 1.5 * 1099511627776.0);
  EXPECT_FALSE(parse_bytes("512", &b));  // no unit: refused, never read as bytes
  ASSERT_TRUE(parse_bytes("512B", &b));
  EXPECT_DOUBLE_EQ(b, 512);
}

TEST(ParseBytes, RejectsNonSizes) {
  double b = 0;
  EXPECT_FALSE(parse_bytes("lots", &b));
  EXPECT_FALSE(parse_bytes("80 parsecs", &b));
  EXPECT_FALSE(parse_bytes("-1GiB", &b));
  EXPECT_FALSE(parse_bytes("", &b));
}

TEST(FormatDouble, RoundTrips) {
  for (double v : {3e-4, 0.1, 1e-8, 0.999, 123456789.0}) EXPECT_EQ(std::stod(format_double(v)), v);
  EXPECT_EQ(format_double(3e-4), "0.0003");
}

TEST(EditDistance, CountsTranspositionsAsOneEdit) {
  EXPECT_EQ(edit_distance("stage", "stage"), 0);
  EXPECT_EQ(edit_distance("satge", "stage"), 1);
  EXPECT_EQ(edit_distance("zero_optimisation", "zero_optimization"), 1);
  EXPECT_EQ(edit_distance("offload-param", "offload_param"), 0);
  EXPECT_EQ(edit_distance("", "abc"), 3);
}

TEST(ClosestMatch, SuggestsOnlyPlausibleTypos) {
  std::vector<std::string> keys = {"reduce_bucket_size", "allgather_bucket_size", "stage"};
  EXPECT_EQ(closest_match("reduce_bucket_sise", keys), "reduce_bucket_size");
  EXPECT_EQ(closest_match("Stage", keys), "stage");
  EXPECT_EQ(closest_match("learning_rate", keys), "");
  // Sharing a tail is not a typo: another start is one or two edits away, no more.
  const std::vector<std::string> blocks = {"tensor_parallel", "pipeline", "zero_optimization"};
  EXPECT_EQ(closest_match("io_parallel", blocks), "");
  EXPECT_EQ(closest_match("tensr_parallel", blocks), "tensor_parallel");
  EXPECT_EQ(closest_match("zensor_parallel", blocks), "tensor_parallel");
  EXPECT_EQ(closest_match("xipeline", blocks), "pipeline");
}
