// read_file and write_file (core/file.h), at their own layer: what every reader of a file
// shares (the load and placement readers are tested on top of them in tests/unit/stats).
#include "eplb/core/file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "eplb/core/error.h"

namespace eplb {
namespace {

namespace fs = std::filesystem;

class FileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("eplb_core_file_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path dir_;
};

TEST_F(FileTest, WriteThenReadGivesTheSameBytes) {
  const std::string path = (dir_ / "a.txt").string();
  const std::string text("one\ntwo\r\n\0three", 15);
  write_file(path, text);
  EXPECT_EQ(read_file(path), text);
  write_file(path, "short");  // truncates
  EXPECT_EQ(read_file(path), "short");
  write_file(path, "");
  EXPECT_EQ(read_file(path), "");
}

TEST_F(FileTest, MissingFileIsAnIoErrorNamingPathAndReason) {
  const std::string path = (dir_ / "nope.json").string();
  try {
    read_file(path);
    ADD_FAILURE() << "did not throw";
  } catch (const IoError& e) {
    EXPECT_EQ(std::string(e.what()), "cannot open " + path + ": No such file or directory");
  }
  const std::string unwritable = (dir_ / "no_dir" / "out.json").string();
  try {
    write_file(unwritable, "x");
    ADD_FAILURE() << "did not throw";
  } catch (const IoError& e) {
    EXPECT_EQ(std::string(e.what()),
              "cannot write " + unwritable + ": No such file or directory");
  }
}

TEST_F(FileTest, DirectoriesAndDevicesAreRefused) {
  try {
    read_file(dir_.string());
    ADD_FAILURE() << "did not throw";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()), dir_.string() + " is a directory, not a file (give a "
                                                     "regular file, or a pipe of at most 4 GiB)");
  }
  EXPECT_THROW(read_file("/dev/zero"), InvalidArgument);  // would never end
}

TEST_F(FileTest, PipesAreRead) {
  const std::string fifo = (dir_ / "loads.fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::thread writer([&] { std::ofstream(fifo) << "through a pipe"; });
  const std::string text = read_file(fifo);
  writer.join();
  EXPECT_EQ(text, "through a pipe");
}

}  // namespace
}  // namespace eplb
